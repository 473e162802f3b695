"""What strict mode costs and what it buys, against plain data-parallel averaging and hybrid mode.

    python bench/consistency.py            # 13.5 minutes here before it was cut to fit 10 (2 busy cores)
    python bench/consistency.py --quick    # about 4 minutes here, with the load of the day
    python bench/consistency.py --quick --step-time-only   # part 1 alone
    python bench/consistency.py --quick --task DIR --entrypoint task:MyTask --hyperparameters '{"batch_size": 32}'
                                           # parts 1 and 2 on a user's task (elastic.tasks)
    python bench/consistency.py --quick --precision bf16   # every arm's forward and loss in bf16 autocast

1. Step time of strict mode against plain DDP-style averaging, same model, same global batch,
   same world size, pairs of short runs of the real worker (elastic.worker.local.LocalJob), the
   arm that runs first alternating from pair to pair. "Plain"
   is the runtime's averaging path (a hybrid job whose batch bounds hold it fixed: one float
   all-reduce of the gradient mean); bench/overhead.py relates that path to torch DDP itself.
   Strict adds the MAX all-reduce of per-tensor magnitudes and the fixed-point conversion; its
   SUM all-reduce is int32 (the bytes of the float one) up to 32 virtual workers. A step's time is
   the gap between consecutive step ends on rank 0; a pair's overhead is the ratio of its two
   medians, printed per pair with its min and max and the load average of each pair. Then
   torch.profiler's top operators of strict steps of the same model in this process.
   On CPU with the digits MLP, the step alone is measured a second way
   (`strict_step_overhead_pct`): a process group per arm, each process holding only its own
   trainer as a worker does, the arms taking turns of 5 steps for 60 rounds (120 in the full
   run; bench.profile_step.interleaved), the median over rounds of each round's ratio of
   medians. Pairs of separate runs see different minutes of a shared VM, where the same matrix
   product's speed drifts by half between runs (1.6 to 3.1 ms a call in one profile); turns a
   few steps apart share the drift. It leaves out the worker's loop around the step (the same
   code in both modes), which the pairs of whole-worker runs include. It is the figure
   (`strict_overhead_pct`; the pairs' median is `strict_overhead_runs_pct`, and the figure with
   --task or --device cuda, where the turns do not run): on a quiet 2-core VM six quick runs of
   pairs gave medians of +4.0 to +7.2 % (pairs within 12 to 22 points of each other) while four
   pairs of 80-step runs gave +1.5 % over their last 50 steps, and the turns +1.3 to +3.7 %;
   py-spy of a strict and a plain worker found no strict-only cost outside the step.
2. The largest absolute parameter difference between a run resized in place and a fixed run of
   the same number of steps, for strict (must be 0), hybrid and plain averaging. The digits CNN
   (batch norm and dropout), 4 virtual workers.
3. Hybrid against strict on 1, 2, 3 and 4 workers: samples per second, and time to the target
   held-out accuracy. Rank 0 writes its checkpoint every 0.1 s; this process evaluates each new
   one, and the job is stopped once one reaches the target; the time is from the end of the
   first step to the end of the step of that checkpoint (resolution: the checkpoint period).

The last line is one JSON object: {"bench": "consistency", "strict_max_abs_diff": ...,
"hybrid_max_abs_diff": ..., "ddp_max_abs_diff": ..., "strict_overhead_pct": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.conditions import (  # noqa: E402
    PYTHON_PATH,
    REDIS_URL,
    RoundRatios,
    TaskModel,
    machine,
    shared_gpu_env,
    show,
)
from bench.profile_step import interleaved, strict_profile  # noqa: E402
from elastic.tasks.runtime import bind_task  # noqa: E402
from elastic.worker.checkpoint import TrainingState, checkpoint_path, load_checkpoint  # noqa: E402
from elastic.worker.local import LocalJob  # noqa: E402
from elastic.workloads import CATALOGUE  # noqa: E402

WARMUP_STEPS = 5
SEED = 3
TARGET_ACCURACY = 0.95
ENDLESS = 10_000_000
OVERHEAD_SPEC: dict[str, Any] = {
    "name": "bench-overhead",
    "workload": "digits-mlp",
    "max_workers": 4,
    "seed": SEED,
    "hyperparameters": {"batch_size": 256, "hidden": 1024, "layers": 3, "dropout": 0.1, "lr": 0.01},
}
CNN_SPEC: dict[str, Any] = {
    "name": "bench-cnn",
    "workload": "digits-cnn",
    "max_workers": 4,
    "seed": SEED,
    "hyperparameters": {"batch_size": 64, "channels": 8, "lr": 0.05},
}
HYBRID = {
    "consistency": "hybrid",
    "batch_per_worker": 16,
    "min_batch_size": 16,
    "max_batch_size": 64,
    "warmup_steps": 20,
}


def hybrid_of(spec: dict[str, Any]) -> dict[str, Any]:
    """Hybrid mode's fields for `spec`: HYBRID for the digits CNN, else the same proportions
    (a quarter of the batch a worker, from one worker's share to the whole batch)."""
    if spec is CNN_SPEC:
        return HYBRID
    quarter = max(1, spec["hyperparameters"]["batch_size"] // 4)
    return {**HYBRID, "batch_per_worker": quarter, "min_batch_size": quarter,
            "max_batch_size": spec["hyperparameters"]["batch_size"]}


def model_parameters(spec: dict[str, Any]) -> int:
    """The parameters of the model `spec` trains."""
    if TASK is not None:
        return sum(p.numel() for p in bind_task(*TASK, spec["hyperparameters"], SEED).model.parameters())
    hp = spec["hyperparameters"]
    return int(
        64 * hp["hidden"] + hp["hidden"] + (hp["layers"] - 1) * (hp["hidden"] ** 2 + hp["hidden"]) + hp["hidden"] * 10 + 10
    )


def plain(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` on the plain averaging path: hybrid with the global batch held where it is."""
    batch = spec["hyperparameters"]["batch_size"]
    return {
        **spec,
        "consistency": "hybrid",
        "batch_per_worker": batch,
        "min_batch_size": batch,
        "max_batch_size": batch,
    }


def environment(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUNGEE_PROGRESS_EVERY_S": "0.001",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_PG_TIMEOUT_S": "30",
        "PYTHONPATH": PYTHON_PATH,
        **shared_gpu_env(DEVICE, 4),
        **extra,
    }


def _gaps(ends: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]


# --- 1. step time ------------------------------------------------------------------------------


TASK: tuple[Path, str] | None = None
DEVICE = "cpu"
"""Where the workers train: "cpu", or "cuda" (GPU i for worker i, or every worker on GPU 0
where the machine has fewer than 4: gloo then, as NCCL refuses two ranks on one GPU)."""
"""--task: the user's task (directory, entrypoint) every run trains instead of the digits."""


def step_times(spec: dict[str, Any], steps: int, workers: int, work: Path) -> list[float]:
    with LocalJob(
        {**spec, "steps": steps}, Path(tempfile.mkdtemp(dir=work)), REDIS_URL, env=environment(), heal=False,
        task=TASK,
        device=DEVICE,
    ) as job:
        job.start(list(range(workers)))
        outputs = job.wait(timeout_s=600)
    return _gaps([event.at for event in outputs[0].of_kind("progress")])


def overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    pairs, steps = (6, 20) if args.quick else (10, 40)
    strict: list[float] = []
    averaged: list[float] = []
    per_pair = []
    loads = []
    spec = {**(args.task_spec or OVERHEAD_SPEC), "max_workers": args.workers}  # V = the world size: one each
    for pair in range(pairs):
        # Alternate which arm runs first, so that neither always follows the other's load.
        if pair % 2 == 0:
            ours = step_times(spec, steps, args.workers, work)
            theirs = step_times(plain(spec), steps, args.workers, work)
        else:
            theirs = step_times(plain(spec), steps, args.workers, work)
            ours = step_times(spec, steps, args.workers, work)
        strict += ours
        averaged += theirs
        ratio = statistics.median(ours) / statistics.median(theirs)
        per_pair.append((ratio - 1) * 100)
        loads.append(round(os.getloadavg()[0], 2))
        print(
            f"  pair {pair + 1} ({'strict' if pair % 2 == 0 else 'plain'} first, load {loads[-1]}): strict "
            f"{statistics.median(ours) * 1000:.2f} ms, plain {statistics.median(theirs) * 1000:.2f} ms a step "
            f"({per_pair[-1]:+.1f}%)",
            flush=True,
        )
    hp = spec["hyperparameters"]
    parameters = model_parameters(spec)
    if TASK is None and DEVICE == "cpu":
        print(
            f"\n  where a strict step's time goes (torch.profiler, top 8 by self CPU time of 10 steps of the "
            f"same model in this process, one virtual worker, world size 1):\n{strict_profile(hp)}"
        )
    pct = statistics.median(per_pair)
    pooled = (statistics.median(strict) / statistics.median(averaged) - 1) * 100
    steady = interleaved_overhead(args, spec) if TASK is None and DEVICE == "cpu" else None
    print(
        f"\nstep time: {spec.get('workload') or spec.get('entrypoint')} {parameters / 1e6:.4f}M parameters, "
        f"global batch {hp['batch_size']}, "
        f"{args.workers} workers (strict: V = {args.workers}, one virtual worker each), "
        f"{pairs} interleaved pairs of {steps}-step runs ({WARMUP_STEPS} warm-up steps left out), "
        f"load average {min(loads)} to {max(loads)}"
    )
    print(f"  strict step: {show(strict, 's', 4)}")
    print(f"  plain step:  {show(averaged, 's', 4)}")
    print(
        f"  strict overhead, per pair of runs (min / median / max): {min(per_pair):+.1f} / {pct:+.1f} / "
        f"{max(per_pair):+.1f}%, the pairs agree within {max(per_pair) - min(per_pair):.1f} points; "
        f"ratio of the pooled medians {pooled:+.1f}%"
    )
    figures: dict[str, Any] = {}
    if steady is not None:
        figures, compared = steady
        print(f"  the step alone, arms in turns, {compared.describe()} (the figure: strict_overhead_pct)")
    return {
        # The figure: the step alone in turns where it was measured (see part 1 of the docstring),
        # else the pairs of whole-worker runs.
        "strict_overhead_pct": figures.get("strict_step_overhead_pct", pct),
        **figures,
        "strict_overhead_runs_pct": pct,
        "strict_overhead_pooled_pct": pooled,
        "overhead_load_average_per_pair": loads,
        "strict_step_median_s": statistics.median(strict),
        "plain_step_median_s": statistics.median(averaged),
        "overhead_per_pair_pct": per_pair,
        "overhead_model_params": parameters,
    }


def interleaved_overhead(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[dict[str, Any], RoundRatios]:
    """The strict step against the plain one alone, the arms taking turns a few steps at a time
    (bench.profile_step.interleaved): its figures for the JSON, and the rounds compared."""
    rounds, block = (60, 5) if args.quick else (120, 5)
    load_before = os.getloadavg()[0]
    per_round = interleaved(spec["hyperparameters"], args.workers, rounds, block)
    load_after = os.getloadavg()[0]
    compared = RoundRatios.of([r["strict"] for r in per_round], [r["plain"] for r in per_round])
    strict = [t for r in per_round for t in r["strict"]]
    plain_times = [t for r in per_round for t in r["plain"]]
    print(
        f"\n  the step alone, in turns: a process group of {args.workers} per arm, each process with its own "
        f"trainer; {rounds} rounds of {block} steps of each arm (the first alternating; the first step of each "
        f"block left out), load average {load_before:.2f} -> {load_after:.2f}"
    )
    print(f"  strict step: {show(strict, 's', 4)}")
    print(f"  plain step:  {show(plain_times, 's', 4)}")
    return {
        "strict_step_overhead_pct": compared.median,
        "strict_step_overhead_pooled_pct": compared.pooled,
        "step_overhead_per_round_pct": compared.per_round,
        "step_overhead_round_iqr_points": compared.iqr,
        "turns_strict_step_median_s": statistics.median(strict),
        "turns_plain_step_median_s": statistics.median(plain_times),
        "turns_load_average": [round(load_before, 2), round(load_after, 2)],
    }, compared


# --- 2. parameter differences after resizes ----------------------------------------------------


def resized_run(
    spec: dict[str, Any], schedule: list[list[int]], per_generation: int, work: Path
) -> TrainingState:
    """Runs `spec` through the placements of `schedule`, `per_generation` steps in each at
    least, stops it and returns its state."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    with LocalJob({**spec, "steps": ENDLESS}, run_dir, REDIS_URL, env=environment(), task=TASK, device=DEVICE) as job:
        for generation, slots in enumerate(schedule, start=1):
            if generation == 1:
                job.start(slots)
            else:
                job.resize(slots)
            _, formed = job.wait_for(
                lambda _, e, g=generation: e.kind == "resized" and e.generation == g, 180
            )
            target = (formed.step or 0) + per_generation
            job.wait_for(
                lambda _, e, g=generation, t=target: (
                    e.kind == "progress" and e.generation == g and (e.step or 0) >= t
                ),
                180,
            )
        job.send_signal(schedule[-1][0], signal.SIGTERM)
        job.wait(120)
    state = load_checkpoint(checkpoint_path(run_dir))
    assert state is not None, job.describe()
    return state


def fixed_run(spec: dict[str, Any], steps: int, workers: int, work: Path) -> TrainingState:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    with LocalJob({**spec, "steps": steps}, run_dir, REDIS_URL, env=environment(), heal=False, task=TASK, device=DEVICE) as job:
        job.start(list(range(workers)))
        job.wait(600)
    state = load_checkpoint(checkpoint_path(run_dir))
    assert state is not None and state.step == steps, job.describe()
    return state


def max_abs_diff(a: TrainingState, b: TrainingState) -> float:
    return max(
        (a.model[name].double() - b.model[name].double()).abs().max().item()
        for name in a.model
        if a.model[name].is_floating_point()
    )


def differences(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    # Quick: one scale-in, which needs no joiner to start (a joiner spends seconds importing
    # torch here, and the fixed reference run must then train as many steps).
    schedule = [[0, 1], [0]] if args.quick else [[0, 1, 2, 3], [0, 1], [0, 1, 2], [0], [0, 1, 2, 3]]
    per_generation = 20 if args.quick else 25
    fixed_workers = len(schedule[0])
    result = {}
    base = args.task_spec or CNN_SPEC
    for label, spec in (("strict", base), ("hybrid", {**base, **hybrid_of(base)}), ("ddp", plain(base))):
        resized = resized_run(spec, schedule, per_generation, work)
        fixed = fixed_run(spec, resized.step, fixed_workers, work)
        result[f"{label}_max_abs_diff"] = max_abs_diff(resized, fixed)
        print(
            f"  {label:7s} resized {' -> '.join(str(len(s)) for s in schedule)} vs fixed {fixed_workers} workers, "
            f"{resized.step} steps: max |parameter difference| {result[f'{label}_max_abs_diff']:.3g}",
            flush=True,
        )
    return result


# --- 3. hybrid against strict ------------------------------------------------------------------


def accuracy_of(state: TrainingState) -> float:
    info = CATALOGUE[CNN_SPEC["workload"]]
    problem = bind_task(info.path, info.entrypoint, CNN_SPEC["hyperparameters"], SEED)
    problem.model.load_state_dict(state.model)
    return problem.evaluate()["accuracy"]


def to_target(spec: dict[str, Any], workers: int, cap_s: float, work: Path) -> dict[str, Any]:
    """Trains on `workers` fixed workers until a checkpoint reaches TARGET_ACCURACY or `cap_s`
    passes; returns samples/s and the time to the target (None if not reached)."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    env = environment(BUNGEE_CHECKPOINT_EVERY_S="0.1")
    reached: tuple[int, float] | None = None
    with LocalJob({**spec, "steps": ENDLESS}, run_dir, REDIS_URL, env=env, heal=False, device=DEVICE) as job:
        job.start(list(range(workers)))
        job.wait_for(lambda _, e: e.kind == "progress", 180)
        began = time.monotonic()
        seen_step = -1
        while time.monotonic() - began < cap_s and reached is None:
            time.sleep(0.1)
            try:
                state = load_checkpoint(checkpoint_path(run_dir))
            except (OSError, RuntimeError, EOFError):
                continue  # being replaced
            if state is None or state.step == seen_step:
                continue
            seen_step = state.step
            accuracy = accuracy_of(state)
            if accuracy >= TARGET_ACCURACY:
                reached = (state.step, accuracy)
        job.send_signal(0, signal.SIGTERM)
        outputs = job.wait(120)
    events = [e for e in outputs[0].of_kind("progress") if e.step is not None]
    first, last = events[0], events[-1]
    batch = last.global_batch or 0
    samples_per_s = (last.step - first.step) * batch / (last.at - first.at) if last.at > first.at else 0.0
    seconds = None
    if reached is not None:
        at_step = next(e.at for e in events if e.step >= reached[0])
        seconds = at_step - first.at
    return {
        "workers": workers,
        "global_batch": batch,
        "samples_per_s": samples_per_s,
        "steps_to_target": reached[0] if reached else None,
        "seconds_to_target": seconds,
    }


def hybrid_against_strict(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    worlds = [1, 2] if args.quick else [1, 2, 3, 4]
    cap_s = 10.0 if args.quick else 20.0
    rows: dict[str, list[dict[str, Any]]] = {"strict": [], "hybrid": []}
    for workers in worlds:
        for label, spec in (("strict", CNN_SPEC), ("hybrid", {**CNN_SPEC, **HYBRID})):
            row = to_target(spec, workers, cap_s, work)
            rows[label].append(row)
            reached = (
                f"{row['seconds_to_target']:.1f} s ({row['steps_to_target']} steps)"
                if row["seconds_to_target"] is not None
                else f"not within {cap_s:.0f} s"
            )
            print(
                f"  {label:6s} {workers} workers, global batch {row['global_batch']:3d}: "
                f"{row['samples_per_s']:8.0f} samples/s, to {TARGET_ACCURACY:.0%} held-out accuracy: {reached}",
                flush=True,
            )
    return {"hybrid_vs_strict": rows, "target_accuracy": TARGET_ACCURACY}


def report(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-consistency-"))
    torch.set_num_threads(1)
    print("\n1. strict against plain averaging, step time", flush=True)
    result: dict[str, Any] = {"bench": "consistency"}
    figures = overhead(args, work)
    trained = f"{TASK[1]} of {TASK[0]}" if TASK is not None else "digits CNN, batch norm, dropout"
    print(f"\n2. parameters after a resize schedule against a fixed run ({trained})", flush=True)
    if args.step_time_only:
        result.update(figures)
        result.update(device=DEVICE, conditions=conditions, wall_s=round(time.monotonic() - began, 1))
        return result
    result.update(differences(args, work))
    result.update(figures)
    if TASK is not None:
        print("\n3. (left out for a user's task: it is timed to the digits CNN's accuracy target)", flush=True)
        result["task"] = f"{TASK[0]} {TASK[1]}"
    else:
        print(
            "\n3. hybrid against strict on fixed worker counts (digits CNN; strict V = 4, batch 64; hybrid 16 a worker)",
            flush=True,
        )
        result.update(hybrid_against_strict(args, work))
    result["device"] = DEVICE
    result["precision"] = args.precision
    result["conditions"] = conditions
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter runs (about 3 minutes)")
    parser.add_argument("--workers", type=int, default=2, help="world size of the step-time comparison")
    parser.add_argument("--step-time-only", action="store_true", help="part 1 alone (the JSON then lacks the differences)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--task", type=Path, help="a user's task directory, trained instead of the digits")
    parser.add_argument("--entrypoint", default="task:Task", help="the task class in --task, module:ClassName")
    parser.add_argument(
        "--hyperparameters", default='{"batch_size": 64}', help="the task's hyperparameters as JSON (batch_size required)"
    )
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32",
        help="every job's spec precision: bf16 autocasts each forward and loss, strict's included",
    )
    args = parser.parse_args(argv)
    for spec in (OVERHEAD_SPEC, CNN_SPEC):
        spec["precision"] = args.precision
    args.task_spec = None
    global DEVICE, TASK
    DEVICE = args.device
    if args.task:
        model = TaskModel(args.task.resolve(), args.entrypoint, json.loads(args.hyperparameters))
        TASK = model.task
        args.task_spec = {
            "name": "bench-task", "code": model.digest, "entrypoint": args.entrypoint, "max_workers": 4,
            "seed": SEED, "hyperparameters": model.hyperparameters, "precision": args.precision,
        }
    result = report(args)
    ordered = {
        key: result.get(key)
        for key in (
            "bench",
            "strict_max_abs_diff",
            "hybrid_max_abs_diff",
            "ddp_max_abs_diff",
            "strict_overhead_pct",
        )
    }
    print(json.dumps({**ordered, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
