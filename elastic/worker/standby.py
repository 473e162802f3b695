"""A warm standby worker: `python -m elastic.worker.standby --module elastic.worker --device D`.

The agent keeps one on each free device (agent.standby). It does the part of a worker's start-up
that is the same for every job, and slow: the interpreter starts, torch, torch.distributed and the
worker runtime are imported (seconds on a busy CPU), and on a GPU the device's context is made.
Then it waits on stdin for one line: its Assignment, as JSON. The assignment holds the worker's
environment, secrets the job's processes may read included, so it goes through the pipe and never
to disk. With it, the standby

1. opens the worker's output file (append) and makes it its stdout and stderr, so that from here
   on it is that worker to the agent: same file, same tailing, same records;
2. takes the worker's environment (the WorkerConfig among it) in place of its own;
3. runs the worker module as `python -m` would (runpy), and exits with its exit code.

A standby serves one worker and ends with it: it never returns to waiting, so no job's modules
(issue 8's user code) are ever imported into a process that serves another job. It imports no
job code, reads no job's data, and holds no job's state while it waits.

End of stdin without a line (the agent died or dropped it) ends it with exit code 0; SIGTERM
while it waits ends it at once (the default action: it holds nothing). A bad assignment ends it
with FAILED_EXIT_CODE and the reason on stderr, which is the worker's output file when it got
that far.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

from pydantic import BaseModel, ConfigDict

from elastic.worker import FAILED_EXIT_CODE

READY_LINE = "standby ready"
"""What the standby prints (to its own output, before any assignment) once it is warm."""


class Assignment(BaseModel):
    """What the agent hands a standby: where the worker's output goes and its environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output: str
    """The worker's output file (the agent's records name it); opened for append."""
    env: dict[str, str]
    """The worker's whole environment; it replaces the standby's."""


WARM_MODULES = (
    "torch.distributed",
    "torch._dynamo",
    "elastic.worker.runner",
    "elastic.worker.transfer",
    "sklearn.datasets",
)
"""Imported before a standby says it is ready. Beyond the worker runtime: torch._dynamo, which
torch imports on the first optimiser's construction (4 s of a joiner's start on a loaded 2-core
machine), and scikit-learn's datasets, which the shipped digits workload reads (4 s more).
Libraries only: never a job's own module, nor a shipped workload's task module. One that is not
installed is skipped."""


def warm_up(device: str) -> None:
    """Imports WARM_MODULES and, on a GPU, makes the device's context. Called once, before the
    standby says it is ready."""
    import importlib

    import torch

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue

    if device.startswith("cuda"):
        # The context costs the device's memory (hundreds of MB) but takes a second or more to
        # make; the standby exists to have paid for it.
        torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)
    torch.ones(4).add_(1)  # the dispatcher's first call is slower than the rest


def take(assignment: Assignment) -> None:
    """Becomes the worker the assignment describes, short of running it: stdout and stderr go
    to its output file and its environment replaces ours."""
    fd = os.open(assignment.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(assignment.env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--module", default="elastic.worker", help="the worker module it runs, once assigned")
    parser.add_argument("--device", default="cpu", help="the torch device it warms up")
    args = parser.parse_args(argv)
    warm_up(args.device)
    print(json.dumps({"standby": READY_LINE, "pid": os.getpid()}), flush=True)
    line = sys.stdin.buffer.readline().strip()
    if not line:
        return 0
    try:
        assignment = Assignment.model_validate_json(line)
    except ValueError as err:
        print(f"standby {os.getpid()}: a bad assignment ({len(line)} bytes): {err}", file=sys.stderr, flush=True)
        return FAILED_EXIT_CODE
    take(assignment)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a worker started by the agent: stdin is /dev/null
    os.close(devnull)
    sys.argv = [args.module]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
