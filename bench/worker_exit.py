"""How long a worker takes to end once it has said its last word (its "exiting" line), ours
against the interpreter's own teardown, side by side in one run.

    python bench/worker_exit.py [--rounds 5] [--steps 6]

Each round runs, for each arm in turn, a job of 2 CPU workers on the 25.6M digits MLP that ends
two ways: completed (its steps done) and stopped (SIGTERM to both while they train, as a cancel
or an owner's return). The arms:

- ours: `python -m elastic.worker`, which runs the atexit handlers, flushes and leaves with
  os._exit (elastic.worker.__main__.leave);
- teardown: the same worker's main returning through `sys.exit`, so that the interpreter tears
  down torch's modules before the process ends (what every worker did before).

Until the process ends its device is not free and the agent cannot report the job's end. Printed:
min / median / max of the seconds from the "exiting" line's arrival to the process's end, per arm
and ending, with the load average; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import PYTHON_PATH, REDIS_URL, RESNET50_SIZED, machine, show, spread  # noqa: E402
from elastic.worker import COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE  # noqa: E402
from elastic.worker.local import LocalJob  # noqa: E402

ARMS = {
    "ours": (sys.executable, "-m", "elastic.worker"),
    "teardown": (
        sys.executable,
        "-c",
        "import sys; from elastic.worker.__main__ import main; sys.exit(main())",
    ),
}
ENDINGS = ("completed", "stopped")


def run_job(command: tuple[str, ...], ending: str, steps: int, work: Path) -> list[float]:
    """One job of 2 workers ended `ending`; each worker's seconds from its exiting line to its end."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUNGEE_PROGRESS_EVERY_S": "0.001",
        "BUNGEE_CHECKPOINT_EVERY_S": "86400",
        "PYTHONPATH": PYTHON_PATH,
    }
    total = steps if ending == "completed" else 10**7
    with LocalJob(RESNET50_SIZED.spec(total), work, REDIS_URL, env=env, heal=False, command=command) as job:
        job.start([0, 1])
        if ending == "stopped":
            job.trained_past(1, steps)
            for slot in (0, 1):
                job.send_signal(slot, signal.SIGTERM)
        outputs = job.wait(300)
    codes = [output.returncode for output in outputs]
    expected = COMPLETED_EXIT_CODE if ending == "completed" else STOPPED_EXIT_CODE
    if codes != [expected, expected]:
        raise RuntimeError(f"the job ended with exit codes {codes}: {[o.stderr[-2000:] for o in outputs]}")
    return [output.exit_s for output in outputs if output.exit_s is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="steps a job trains before it ends")
    args = parser.parse_args(argv)
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    seconds: dict[str, dict[str, list[float]]] = {arm: {ending: [] for ending in ENDINGS} for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bungee-exit-") as scratch:
        for round_index in range(args.rounds):
            order = list(ARMS) if round_index % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                for ending in ENDINGS:
                    work = Path(scratch) / f"{arm}-{ending}-{round_index}"
                    values = run_job(ARMS[arm], ending, args.steps, work)
                    seconds[arm][ending].extend(values)
                    print(
                        f"round {round_index + 1} {arm:8} {ending:9} "
                        + ", ".join(f"{v:.3f}" for v in values)
                        + f" s (load {os.getloadavg()[0]:.2f})",
                        flush=True,
                    )
    load_after = round(os.getloadavg()[0], 2)
    print(
        f"\nfrom the exiting line to the process's end, 2 workers a job, {args.rounds} rounds "
        f"(load {conditions['load_average_1m']} at the start, {load_after} at the end):"
    )
    summary: dict[str, Any] = {
        "bench": "worker_exit",
        "rounds": args.rounds,
        **conditions,
        "load_after": load_after,
    }
    for ending in ENDINGS:
        ours, baseline = seconds["ours"][ending], seconds["teardown"][ending]
        print(f"  {ending:9} ours {show(ours)}   teardown {show(baseline)}")
        summary[ending] = {"ours": spread(ours), "teardown": spread(baseline)}
        if ours and baseline:
            summary[ending]["median_saved_s"] = round(
                statistics.median(baseline) - statistics.median(ours), 3
            )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
