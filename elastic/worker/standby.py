"""A warm standby worker: `python -m elastic.worker.standby --module elastic.worker --device D`.

The agent keeps one on each free device (agent.standby). It does the part of a worker's start-up
that is the same for every job, and slow: the interpreter starts, torch, torch.distributed and the
worker runtime are imported (seconds on a busy CPU), and on a GPU the device's context is made.
Then it waits on stdin for its Assignment, one line of JSON. The assignment holds the worker's
environment, secrets the job's processes may read included, so it goes through the pipe and never
to disk. Before it, the agent may send one Preparation (also one line): the environment of a
worker the job may ask for on this device next, rank and generation still provisional. The
standby takes that environment and makes the job's build (elastic.worker.build: the task's code,
model, optimiser, trainer and a warm-up pass), still at idle priority, and prints PREPARED_LINE
(or PREPARATION_FAILED_LINE with the error: the worker will build, and fail, on its own). A standby
prepared for a job is handed that job's worker or killed, never another's. With the assignment,
the standby

1. opens the worker's output file (append) and makes it its stdout and stderr, so that from here
   on it is that worker to the agent: same file, same tailing, same records;
2. takes the worker's environment (the WorkerConfig among it) in place of its own;
3. runs the worker module as `python -m` would (runpy), and exits with its exit code.

A standby serves one worker and ends with it: it never returns to waiting, so no job's modules
(users' own code) are ever imported into a process that serves another job. Unprepared, it
imports no job code, reads no job's data, and holds no job's state while it waits; prepared,
it holds one job's freshly built model (never its training state, which reaches the worker from
the others' memory once it joins). What the job's code prints while it is prepared goes to the
standby's own output, which the agent deletes when it hands the standby a worker.

End of stdin without a line (the agent died or dropped it) ends it with exit code 0; its agent's
SIGTERM while it waits ends it at once (the default action: it holds nothing). A SIGTERM from
anyone else is dropped from its start on (elastic.worker.stop: a cluster engine's TERM to the
agent's whole job is the agent's to act on), and the worker it becomes keeps that rule. A bad
assignment ends it with FAILED_EXIT_CODE and the reason on stderr, which is the worker's output
file when it got that far.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
import time
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from elastic.worker import FAILED_EXIT_CODE
from elastic.worker.confine import CONFINED_ENV, ConfinementError, confine_from_env, make_undumpable
from elastic.worker.stop import agent_pid, guard_term

READY_LINE: Final = "standby ready"
"""What the standby prints (to its own output, before any assignment) once it is warm."""
PREPARED_LINE: Final = "standby prepared"
"""What it prints once it has made the build of the job it was prepared for."""
PREPARATION_FAILED_LINE: Final = "standby preparation failed"
"""What it prints, with the error, when the job's build failed while it was prepared."""


class Preparation(BaseModel):
    """What the agent may send a standby before its assignment: the environment of the worker a
    job may ask for on its device (elastic.worker.build says what is made of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["prepare"] = "prepare"
    env: dict[str, str]


class Assignment(BaseModel):
    """What the agent hands a standby: where the worker's output goes and its environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["assign"] = "assign"
    output: str
    """The worker's output file (the agent's records name it); opened for append."""
    env: dict[str, str]
    """The worker's whole environment; it replaces the standby's."""


MESSAGE: TypeAdapter[Preparation | Assignment] = TypeAdapter(
    Annotated[Preparation | Assignment, Field(discriminator="kind")]
)
"""One line on a standby's stdin."""


class Ready(BaseModel):
    """Said once the standby is warm (READY_LINE)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    standby: Literal["standby ready"] = READY_LINE
    pid: int


class Prepared(BaseModel):
    """Said once the build of the job it was prepared for is made: how long it took, by part."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    standby: Literal["standby prepared"] = PREPARED_LINE
    job: int
    seconds: float
    parts: dict[str, float]


class PreparationFailed(BaseModel):
    """Said when that job's build failed (its code, or a configuration a worker would refuse too)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    standby: Literal["standby preparation failed"] = PREPARATION_FAILED_LINE
    job: int | None
    error: str = Field(max_length=2000)


SAID: TypeAdapter[Ready | Prepared | PreparationFailed] = TypeAdapter(
    Annotated[Ready | Prepared | PreparationFailed, Field(discriminator="standby")]
)
"""One line a standby prints to its output for the agent (before it becomes a worker)."""
_SAID_START = b'{"standby"'


def said(output: bytes) -> list[Ready | Prepared | PreparationFailed]:
    """What a standby told its agent in `output` (its output file), in order: the lines of the
    protocol; any other line (a library's, the job's code's while it built) is not one of them."""
    told = []
    for line in output.splitlines():
        if line.startswith(_SAID_START):
            try:
                told.append(SAID.validate_json(line))
            except ValueError:  # pydantic's ValidationError is one
                continue
    return told

WARM_MODULES = (
    "torch.distributed",
    "torch._dynamo",
    "elastic.worker.runner",
    "elastic.worker.build",
    "elastic.worker.transfer",
    "sklearn.datasets",
)
"""Imported before a standby says it is ready. Beyond the worker runtime: torch._dynamo, which
torch imports on the first optimiser's construction (4 s of a joiner's start on a loaded 2-core
machine), and scikit-learn's datasets, which the shipped digits workload reads (4 s more).
Libraries only: never a job's own module, nor a shipped workload's task module. One that is not
installed is skipped."""


def warm_modules(worker_module: str) -> tuple[str, ...]:
    """What a standby for `worker_module` imports before it says it is ready: the module's own
    STANDBY_IMPORTS where it names them (an agent's `--worker-module` of another kind knows what
    it needs; a stand-in without torch needs nothing), else WARM_MODULES. Importing the worker
    module runs no job: its `__main__` runs only once the standby is handed a worker."""
    try:
        module = importlib.import_module(worker_module)
    except ImportError:
        return WARM_MODULES
    return tuple(getattr(module, "STANDBY_IMPORTS", WARM_MODULES))


def warm_up(device: str, modules: tuple[str, ...] = WARM_MODULES) -> None:
    """Imports `modules` and, on a GPU, makes the device's context. Called once, before the
    standby says it is ready."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    if "torch" not in sys.modules and not device.startswith("cuda"):
        return
    import torch

    if device.startswith("cuda"):
        # The context costs the device's memory (hundreds of MB) but takes a second or more to
        # make; the standby exists to have paid for it.
        torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)
    torch.ones(4).add_(1)  # the dispatcher's first call is slower than the rest


def replace_environment(env: dict[str, str]) -> None:
    """Takes `env` in place of this process's environment, keeping the mark of a process confined
    already (a standby started in a job's own environment is confined from its start: the mark
    tells elastic.worker.confine not to confine it again), and the home and /tmp its confinement
    gave it."""
    confined = os.environ.get(CONFINED_ENV) == "1"
    home = os.environ.get("HOME")
    os.environ.clear()
    os.environ.update(env)
    if confined:
        os.environ[CONFINED_ENV] = "1"
        os.environ.pop("TMPDIR", None)
        if home is not None:
            os.environ["HOME"] = home


def take(assignment: Assignment) -> None:
    """Becomes the worker the assignment describes, short of running it: stdout and stderr go
    to its output file and its environment replaces ours."""
    fd = os.open(assignment.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    replace_environment(assignment.env)


def prepare(preparation: Preparation) -> None:
    """Takes the preparation's environment and makes the build of its worker's job, held for the
    worker this process becomes; says how it went on stdout (PREPARED_LINE or
    PREPARATION_FAILED_LINE). The job's code failing is not the standby's failure."""
    from elastic.wire import WorkerConfig
    from elastic.worker import WORKER_CONFIG_ENV, build
    from elastic.worker.settings import WorkerSettings

    began = time.monotonic()
    replace_environment(preparation.env)
    job = None
    try:
        config = WorkerConfig.model_validate_json(os.environ[WORKER_CONFIG_ENV])
        job = config.job_id
        confine_from_env()  # before the job's code runs
        made = build.prepare(config, WorkerSettings.from_env(os.environ))
    except Exception as err:  # the job's code, or a config the worker would refuse as well
        failed = PreparationFailed(job=job, error=f"{type(err).__name__}: {err}"[:2000])
        print(failed.model_dump_json(), flush=True)
        return
    seconds = round(time.monotonic() - began, 3)
    print(Prepared(job=job, seconds=seconds, parts=made.seconds).model_dump_json(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--module", default="elastic.worker", help="the worker module it runs, once assigned")
    parser.add_argument("--device", default="cpu", help="the torch device it warms up")
    args = parser.parse_args(argv)
    # Before any thread starts (torch's, a prepared build's): SIGTERM goes through the gate
    # (elastic.worker.stop) from now on, in the standby and in the worker it becomes, and a
    # thread started before the gate would take a TERM past it.
    guard_term(agent_pid())
    make_undumpable()  # a platform process until it is confined as a job (a forked one is already)
    warm_up(args.device, warm_modules(args.module))
    print(Ready(pid=os.getpid()).model_dump_json(), flush=True)
    prepared = False
    assignment = None
    while assignment is None:
        line = sys.stdin.buffer.readline().strip()
        if not line:
            return 0
        try:
            message = MESSAGE.validate_json(line)
        except ValueError as err:
            print(f"standby {os.getpid()}: a bad message ({len(line)} bytes): {err}", file=sys.stderr, flush=True)
            return FAILED_EXIT_CODE
        if isinstance(message, Assignment):
            assignment = message
            continue
        if prepared:  # one job's modules are in this process: it may not be prepared again
            print(f"standby {os.getpid()}: prepared twice", file=sys.stderr, flush=True)
            return FAILED_EXIT_CODE
        prepare(message)
        prepared = True
    take(assignment)
    try:
        confine_from_env()  # a prepared standby was confined already: nothing to do
    except ConfinementError as err:
        print(f"the job's process could not be confined: {err}", file=sys.stderr, flush=True)
        return FAILED_EXIT_CODE
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a worker started by the agent: stdin is /dev/null
    os.close(devnull)
    sys.argv = [args.module]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
