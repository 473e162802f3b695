"""Replays Pollux-format workloads through Bungee's scheduling policies and prints what they
achieve; with --decision-time, times the policies' decisions at 64, 512 and 2,048 devices.

    python bench/simulate.py                          # all eight 1.0x workloads, means
    python bench/simulate.py --load 2.0               # all eight 2.0x workloads
    python bench/simulate.py --workload PATH.csv [--resize-cost S]
    python bench/simulate.py --decision-time

The last line is one JSON object (bench/SIMULATION.md describes the fields).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.scheduling.registry import POLICY_NAMES, get_policy  # noqa: E402
from elastic.simulator.engine import SimulationConfig  # noqa: E402
from elastic.simulator.experiment import LOAD_FOLDERS, mean_summary, run_experiment, standard_workloads  # noqa: E402
from elastic.simulator.metrics import Summary  # noqa: E402
from elastic.simulator.synthetic import jobs_for, synthetic_snapshot  # noqa: E402
from elastic.simulator.traces import DEFAULT_TRACES, load_applications  # noqa: E402

REPORTED_POLICIES = ("bungee", "fifo", "tiresias", "optimus", "saxena")
OUR_RESIZE_COST_S = 1.0
"""Our in-place resize pause until the resize benchmark reports its own figure."""
DECISION_SIZES = (64, 512, 2048)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--workload",
        type=Path,
        action="append",
        help="a workload CSV (repeatable); default: all eight of --load",
    )
    parser.add_argument(
        "--load", choices=sorted(LOAD_FOLDERS), default="1.0", help="which eight workloads when no --workload"
    )
    parser.add_argument(
        "--resize-cost",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a resize pauses a job (30: Pollux's assumption; ours: 1.0)",
    )
    parser.add_argument(
        "--start-cost",
        type=float,
        default=None,
        metavar="S",
        help="seconds a (re)start pauses a job (default: the resize cost)",
    )
    parser.add_argument("--round", type=float, default=60.0, metavar="S", help="scheduling round length")
    parser.add_argument(
        "--policies",
        default=",".join(REPORTED_POLICIES),
        help=f"comma-separated, from {', '.join(POLICY_NAMES)}",
    )
    parser.add_argument(
        "--strict", action="store_true", help="jobs keep their batch size (strict mode) under every policy"
    )
    parser.add_argument(
        "--learn-throughput",
        action="store_true",
        help="policies learn each job's curve online from a generic prior instead of the fitted one",
    )
    parser.add_argument(
        "--no-remaining-work", action="store_true", help="jobs do not say how much work they have left"
    )
    parser.add_argument(
        "--remaining-error",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="log-normal error on each job's remaining-work figure (0: exact)",
    )
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="the Pollux artifact folder")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="only the jobs submitted in the first two hours")
    parser.add_argument(
        "--decision-time", action="store_true", help="time decisions at 64, 512 and 2,048 devices instead"
    )
    parser.add_argument(
        "--decision-sizes",
        default=",".join(map(str, DECISION_SIZES)),
        help="device counts for --decision-time",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [p for p in args.policies.split(",") if p not in POLICY_NAMES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}")
    try:
        args.decision_sizes = [int(v) for v in args.decision_sizes.split(",")]
    except ValueError:
        parser.error(f"--decision-sizes must be comma-separated integers, got {args.decision_sizes!r}")
    if args.resize_cost < 0 or (args.start_cost is not None and args.start_cost < 0) or args.round <= 0:
        parser.error("costs must be >= 0 and the round > 0")
    return args


def conditions(extra: str) -> str:
    return (
        f"# machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}; {extra}"
    )


def print_table(by_policy: dict[str, list[Summary]], means: dict[str, Summary], workloads: int) -> None:
    header = (
        f"{'policy':<9} {'avg JCT s':>10} {'p50 s':>8} {'p99 s':>8} {'makespan s':>10} {'queue s':>8} "
        f"{'alloc %':>7} {'useful %':>8} {'resizes':>7} {'dec p50 ms':>10} {'dec p95 ms':>10} {'unfinished':>10}"
    )
    print(header)
    for policy, mean in means.items():
        print(
            f"{policy:<9} {mean.avg_jct_s:>10.0f} {mean.p50_jct_s:>8.0f} {mean.p99_jct_s:>8.0f} {mean.makespan_s:>10.0f} "
            f"{mean.avg_queueing_s:>8.0f} {100 * mean.allocated_utilization:>7.1f} {100 * mean.useful_utilization:>8.1f} "
            f"{mean.resizes_per_job:>7.2f} {mean.decision_p50_ms:>10.2f} {mean.decision_p95_ms:>10.2f} {mean.unfinished:>10d}"
        )
    if workloads > 1:
        print(f"# per-workload avg JCT (s), {workloads} workloads:")
        for policy, summaries in by_policy.items():
            values = [s.avg_jct_s for s in summaries]
            print(
                f"#   {policy:<9} min {min(values):.0f} median {float(np.median(values)):.0f} max {max(values):.0f}: "
                + " ".join(f"{v:.0f}" for v in values)
            )


def simulate(args: argparse.Namespace) -> dict[str, object]:
    workloads = args.workload or standard_workloads(args.traces, args.load)
    policies = args.policies.split(",")
    config = SimulationConfig(
        round_s=args.round,
        resize_cost_s=args.resize_cost,
        start_cost_s=args.start_cost,
        consistency="strict" if args.strict else "hybrid",
        remaining_known=not args.no_remaining_work,
        remaining_error=args.remaining_error,
        learn_throughput=args.learn_throughput,
    )
    print(
        conditions(
            f"16 nodes x 4 GPUs, {args.round:g} s rounds, resize cost {args.resize_cost:g} s, start cost "
            f"{config.start_cost:g} s, jobs {'strict' if args.strict else 'hybrid'}, remaining work "
            f"{'withheld' if args.no_remaining_work else f'known, log-normal error {args.remaining_error:g}'}, "
            f"throughput curves {'learned online from a prior' if args.learn_throughput else 'fitted to the trace'}, "
            f"{len(workloads)} workload(s): {', '.join(str(w) for w in workloads)}"
            + (", first 2 h of submissions only (--quick)" if args.quick else "")
        )
    )
    started = time.perf_counter()
    by_policy = run_experiment(
        workloads, policies, config, args.traces, args.processes, first_hours=2.0 if args.quick else None
    )
    means = {p: mean_summary(s) for p, s in by_policy.items()}
    print_table(by_policy, means, len(workloads))
    print(f"# wall time {time.perf_counter() - started:.1f} s with {args.processes} process(es)")
    return {
        "bench": "simulate",
        "avg_jct_s": {p: round(m.avg_jct_s, 1) for p, m in means.items()},
        "p99_jct_s": {p: round(m.p99_jct_s, 1) for p, m in means.items()},
        "utilization": {p: round(m.allocated_utilization, 4) for p, m in means.items()},
        "resizes_per_job": {p: round(m.resizes_per_job, 3) for p, m in means.items()},
    }


def _repeats(devices: int) -> int:
    return 40 if devices <= 64 else 15 if devices <= 512 else 7


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def decision_time(args: argparse.Namespace) -> dict[str, object]:
    """Wall time of each decision, the figure a scheduling cycle waits for, and the CPU time of
    this process during it: on a shared machine the wall time also counts the waits for a core,
    which the CPU time leaves out."""
    apps = load_applications(args.traces)
    policies = args.policies.split(",")
    sizes: list[int] = args.decision_sizes
    print(
        conditions(
            "synthetic clusters of 4-device nodes; jobs: "
            + ", ".join(f"{d} devices -> {jobs_for(d)}" for d in sizes)
            + f"; load average at the start {_load()}"
        )
    )
    print(f"{'policy':<9} " + " ".join(f"{f'{d} p50/p95 ms':>22}" for d in sizes))
    results: dict[str, dict[int, tuple[float, float]]] = {}
    cpu: dict[str, dict[int, tuple[float, float]]] = {}
    for name in policies:
        policy = get_policy(name, resize_cost_s=args.resize_cost)
        results[name], cpu[name] = {}, {}
        for devices in sizes:
            times, cpu_times = [], []
            for seed in range(_repeats(devices)):
                snapshot = synthetic_snapshot(devices, apps, seed, warm_with=policy)
                began, began_cpu = time.perf_counter(), time.process_time()
                policy(snapshot)
                times.append((time.perf_counter() - began) * 1000.0)
                cpu_times.append((time.process_time() - began_cpu) * 1000.0)
            results[name][devices] = (float(np.percentile(times, 50)), float(np.percentile(times, 95)))
            cpu[name][devices] = (float(np.percentile(cpu_times, 50)), float(np.percentile(cpu_times, 95)))
        print(
            f"{name:<9} "
            + " ".join(f"{results[name][d][0]:>10.1f} / {results[name][d][1]:>9.1f}" for d in sizes)
        )
    print("# CPU time of this process per decision, p50 / p95 ms:")
    for name in policies:
        print(
            f"#   {name:<9} "
            + "  ".join(f"{d}: {cpu[name][d][0]:.1f} / {cpu[name][d][1]:.1f}" for d in sizes)
        )
    reported = "bungee" if "bungee" in results else policies[0]
    print(
        f"# the JSON line reports {reported}; decisions timed per size: {', '.join(f'{d}: {_repeats(d)}' for d in sizes)}"
        f"; load average at the end {_load()}"
    )
    return {
        "bench": "decision_time",
        "p50_ms": {str(d): round(results[reported][d][0], 2) for d in sizes},
        "p95_ms": {str(d): round(results[reported][d][1], 2) for d in sizes},
        "cpu_p50_ms": {str(d): round(cpu[reported][d][0], 2) for d in sizes},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    line = decision_time(args) if args.decision_time else simulate(args)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
