"""A stand-in for `python -m elastic.worker` in the agent's tests: no torch, fast, and told by
its spec how to behave. It reads its WorkerConfig like the real worker, prints one plain line
describing where it runs, then a progress event per step. SIGTERM makes it stop at the next
step boundary with STOPPED_EXIT_CODE, as the real worker does, and like it, it announces its exit
code in an "exiting" event as its last line.

Spec keys: steps (default 1000), step_s (default 0.02), busy (spin the CPU instead of
sleeping), crash_at_step and crash_code (exit with that code at that step), joins_at_step and
joins_generation (say it joined that generation, with its rank, after that step), sigterm ("stop",
the default; "ignore"; "die": the default action, as before a handler is installed), child
(start a sleeping child process and name its pid), long_line (print a line this long), exit_file
and exit_code (exit with that code, default 0, at the first step boundary where that file exists),
teardown_s (after announcing its exit, print "tearing down" and take this long to exit, with
SIGTERM's default action back, as in the interpreter's teardown), config_out (write the
WorkerConfig it was given, as JSON, into this directory as <rank>.json).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic.wire import WORKER_EVENT_PREFIX, UserError, WorkerConfig, WorkerEvent
from elastic.worker import STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE, WORKER_CONFIG_ENV
from elastic.worker.events import announce_exit

STANDBY_IMPORTS: tuple[str, ...] = ()
"""What a standby for this worker imports before it is ready (elastic.worker.standby.warm_modules):
nothing, as this worker needs no torch, so that the agent's tests wait for no import of it."""

JOINS_ENV = "FAKE_WORKER_JOINS"
FAILURES: list[UserError] = []
"""What "its code" raised, announced with its exit (spec: user_error_at_step)."""
"""Set: the worker says "joined" (its own generation) after its first step, whatever its spec."""


def main() -> int:
    config = WorkerConfig.model_validate_json(os.environ[WORKER_CONFIG_ENV])
    spec = config.spec
    stop_requested = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    actions: dict[str, Any] = {"stop": on_sigterm, "ignore": signal.SIG_IGN, "die": signal.SIG_DFL}
    signal.signal(signal.SIGTERM, actions[spec.get("sigterm", "stop")])
    affinity = sorted(os.sched_getaffinity(0))
    print(
        f"fake worker rank={config.rank} device={config.device} "
        f"cuda={os.environ.get('CUDA_VISIBLE_DEVICES')} omp={os.environ.get('OMP_NUM_THREADS')} "
        f"affinity={','.join(map(str, affinity))}",
        flush=True,
    )
    if spec.get("config_out"):
        (Path(spec["config_out"]) / f"{config.rank}.json").write_text(config.model_dump_json())
    if spec.get("child"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child pid={child.pid}", flush=True)
    if spec.get("long_line"):
        print("x" * int(spec["long_line"]), flush=True)
    print(f"{WORKER_EVENT_PREFIX}{{not json", flush=True)

    generation = config.generation

    def emit(kind: str, **fields: object) -> None:
        event = WorkerEvent(
            job_id=config.job_id,
            generation=generation,
            rank=config.rank,
            kind=kind,  # type: ignore[arg-type]
            at=time.time(),
            **fields,  # type: ignore[arg-type]
        )
        print(WORKER_EVENT_PREFIX + event.model_dump_json(exclude_none=True), flush=True)

    steps = int(spec.get("steps", 1000))
    step_s = float(spec.get("step_s", 0.02))
    for step in range(1, steps + 1):
        if spec.get("busy"):
            until = time.monotonic() + step_s
            while time.monotonic() < until:
                pass
        else:
            time.sleep(step_s)
        if spec.get("exit_file") and os.path.exists(spec["exit_file"]):
            return int(spec.get("exit_code", 0))
        if spec.get("user_error_at_step") == step:
            FAILURES.append(UserError(error="loss() raised ValueError: fake", traceback='  File "task.py", line 9'))
            return USER_ERROR_EXIT_CODE
        if spec.get("crash_at_step") == step:
            print("fake worker crashing", flush=True)
            return int(spec.get("crash_code", 3))
        emit("progress", step=step, total_steps=steps, loss=1.0 / step)
        if spec.get("joins_at_step") == step:
            generation = int(spec["joins_generation"])
            emit("joined", pid=os.getpid())
        elif step == 1 and os.environ.get(JOINS_ENV):  # as a real worker entering its generation
            emit("joined", pid=os.getpid())
        if stop_requested:
            emit("log", message=f"stopping after step {step}")
            return STOPPED_EXIT_CODE
    return 0


if __name__ == "__main__":
    code = main()
    announce_exit(code, user_error=FAILURES[0] if FAILURES else None)
    teardown_s = float(
        WorkerConfig.model_validate_json(os.environ[WORKER_CONFIG_ENV]).spec.get("teardown_s", 0)
    )
    if teardown_s:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("tearing down", flush=True)
        time.sleep(teardown_s)
    sys.exit(code)
