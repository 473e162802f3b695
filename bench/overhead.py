"""What the elastic runtime costs a job that is not being resized: its steady-state step time
against plain DDP on the same model, data and world size.

    python bench/overhead.py            # 25.6M model, 2 workers, 4 interleaved pairs of runs
    python bench/overhead.py --quick    # 2 pairs, fewer steps (about 3 minutes)
    python bench/overhead.py --device cuda

The elastic side is the real worker (elastic.worker.local.LocalJob, membership board in Redis,
rank 0's watcher thread, the step's all-reduce carrying the stop and switch votes); the plain
side is bench/torchrun_train.py under `torchrun --standalone` without its stop vote. A third
arm, the elastic worker whose rank 0 does not poll the board, isolates what the coordination
costs from what the trainer's design (one flat all-reduce into which backward writes the
gradients, against DDP's buckets) gains or loses. Runs alternate, so that a change in the
machine's load hits all arms. A step's time is the gap between consecutive step ends on rank 0, the first steps of a
run left out; the overhead is the ratio of the medians.

The last line is one JSON object: {"bench": "overhead", "overhead_pct": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import PYTHON_PATH, REDIS_URL, RESNET50_SIZED, ROOT, BenchModel, machine, show  # noqa: E402
from elastic.worker.local import LocalJob  # noqa: E402

WARMUP_STEPS = 5


def _gaps(ends: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)][WARMUP_STEPS:]


def elastic_steps(
    model: BenchModel, steps: int, workers: int, device: str, work: Path, poll_s: float = 0.05
) -> list[float]:
    """Step times of the elastic runtime; rank 0 reads the membership board every `poll_s`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUNGEE_PROGRESS_EVERY_S": "0.001",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "BUNGEE_MEMBERSHIP_POLL_S": str(poll_s),
        "PYTHONPATH": PYTHON_PATH,
    }
    with LocalJob(
        model.spec(steps), Path(tempfile.mkdtemp(dir=work)), REDIS_URL, env=env, heal=False, device=device
    ) as job:
        job.start(list(range(workers)))
        outputs = job.wait(timeout_s=1200)
    leader = outputs[0].of_kind("progress")
    return _gaps([event.at for event in leader])


def plain_steps(model: BenchModel, steps: int, workers: int, device: str, work: Path) -> list[float]:
    folder = Path(tempfile.mkdtemp(dir=work))
    timeline = folder / "timeline"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        str(ROOT / "bench" / "torchrun_train.py"),
        "--spec",
        json.dumps(model.spec(steps)),
        "--checkpoint",
        str(folder / "checkpoint.pt"),
        "--timeline",
        str(timeline),
        "--device",
        device,
        "--no-stop-flag",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHON_PATH}
    done = subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1200
    )
    if done.returncode != 0:
        raise RuntimeError(f"the torchrun baseline exited {done.returncode}:\n{done.stderr[-3000:]}")
    return _gaps([float(line.split()[1]) for line in timeline.read_text().splitlines()])


def report(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    pairs, steps = (2, 30) if args.quick else (4, 60)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-overhead-"))
    model = RESNET50_SIZED
    elastic: list[float] = []
    plain: list[float] = []
    per_pair = []
    quiet: list[float] = []
    for pair in range(pairs):
        ours = elastic_steps(model, steps, args.workers, args.device, work)
        theirs = plain_steps(model, steps, args.workers, args.device, work)
        unpolled = elastic_steps(model, steps, args.workers, args.device, work, poll_s=3600)
        elastic += ours
        plain += theirs
        quiet += unpolled
        ratio = statistics.median(ours) / statistics.median(theirs)
        per_pair.append(ratio)
        print(
            f"  pair {pair + 1}: elastic {statistics.median(ours) * 1000:.1f} ms, plain DDP "
            f"{statistics.median(theirs) * 1000:.1f} ms a step ({(ratio - 1) * 100:+.2f}%)",
            flush=True,
        )
    overhead = (statistics.median(elastic) / statistics.median(plain) - 1) * 100
    coordination = (statistics.median(elastic) / statistics.median(quiet) - 1) * 100
    print(
        f"\n{model.label} model ({model.parameters / 1e6:.1f}M parameters), {args.workers} workers, device "
        f"{args.device}, {pairs} interleaved pairs of {steps}-step runs ({WARMUP_STEPS} warm-up steps left out)"
    )
    print(f"  elastic runtime step: {show(elastic)}")
    print(f"  plain DDP step:       {show(plain)}")
    print(f"  elastic, board not polled: {show(quiet)}")
    print(
        f"  overhead (ratio of medians): {overhead:+.2f}%; per pair {', '.join(f'{(r - 1) * 100:+.2f}%' for r in per_pair)}"
    )
    print(f"  of which the coordination (rank 0 reading the board every 50 ms): {coordination:+.2f}%")
    return {
        "bench": "overhead",
        "overhead_pct": overhead,
        "elastic_step_median_s": statistics.median(elastic),
        "plain_ddp_step_median_s": statistics.median(plain),
        "per_pair_pct": [(r - 1) * 100 for r in per_pair],
        "coordination_overhead_pct": coordination,
        "elastic_unpolled_step_median_s": statistics.median(quiet),
        "model_params": model.parameters,
        "workers": args.workers,
        "device": args.device,
        "conditions": conditions,
        "wall_s": round(time.monotonic() - began, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 pairs of shorter runs (about 3 minutes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(report(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
