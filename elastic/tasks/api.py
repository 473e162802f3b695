"""What a task class defines, and the errors that blame the user's code rather than the cluster.

A task is a class named in the job spec as `module:ClassName`, the module found in the job's code
directory. Bungee constructs it with the job's hyperparameters and calls:

    model()                     -> torch.nn.Module. Called once, right after torch's generator is
                                   seeded with the job's seed, so the initial weights depend only
                                   on that seed.
    optimizer(model)            -> torch.optim.Optimizer over model's parameters.
    train_data()                -> a map-style torch.utils.data.Dataset (`__len__`,
                                   `__getitem__`). Items are read one at a time, when a step needs
                                   them: a data set need not fit in memory.
    loss(model, batch)          -> a scalar tensor, the mean loss over the batch, or a pair
                                   (tensor, {name: float}) adding named metrics.

and, when the class defines them:

    Hyperparameters             a pydantic model class: the job's hyperparameters are validated
                                with it, and the task receives the validated instance (otherwise
                                the dict as submitted). It must have `batch_size`, the global
                                batch; strict mode's virtual workers and hybrid mode's per-worker
                                batches are cut from it. Hybrid mode also reads `lr`.
    scheduler(optimizer)        -> a torch.optim.lr_scheduler.LRScheduler over the optimiser,
                                   stepped once after every global step. Its state travels with
                                   the optimiser's to joiners and into checkpoints. In hybrid
                                   mode the rate it sets is multiplied by hybrid mode's scaling
                                   and warm-up factor.
    data_workers                an int class attribute: reader processes for the training
                                   items (elastic.tasks.readers), each item seeded by its place
                                   in the sample stream; 0 (the default): read in the worker.
    collate(items)              -> one batch from a list of dataset items (default: torch's
                                   default_collate, which stacks tensors and numbers).
    eval_data()                 -> a Dataset held out from training.
    evaluate(model, batch)      -> {name: float}: metrics of one evaluation batch, averaged over
                                   the batches weighted by their sizes.

What the task may know of its job is in `self.job`, a read-only `Job` that Bungee sets on the
task right after constructing it (so in every method above, though not yet in `__init__`):

    job.steps                   the steps the job trains in all (the spec's `steps`, or its
                                `epochs` in steps): what a learning-rate schedule decays over.
    job.seed                    the job's seed.

A task whose own `__init__` sets an attribute `job` keeps its own.

A step draws its randomness (dropout, a random crop in `__getitem__`) from torch's, numpy's and
Python's generators, which the runtime seeds for each step (and each virtual worker in strict
mode) before the step's items are read: a task must not keep generators of its own."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

TASK_METHODS = ("model", "optimizer", "train_data", "loss")
"""What every task class defines."""
OPTIONAL_TASK_METHODS = ("scheduler", "collate", "eval_data", "evaluate")


@dataclass(frozen=True)
class Job:
    """What a task may know of its job, set on the task as `job` (see above)."""

    steps: int
    """The steps the job trains in all: the spec's `steps`, or its `epochs` in steps."""
    seed: int
    """The job's seed."""


class UserCodeError(Exception):
    """The job's own code failed in a way that will fail again on any node: an import error, a
    missing method, an exception in `loss`, a NaN loss. The job fails at once, with
    `traceback_text`, and is never restarted for it."""

    def __init__(self, message: str, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback_text = traceback_text


class TaskDefinitionError(UserCodeError):
    """The entrypoint does not name a usable task: no such module or class, a required method
    missing, or hyperparameters its schema refuses."""


def _under(filename: str, directory: Path) -> str | None:
    """`filename` relative to `directory` if it lies there, else None."""
    try:
        return str(Path(filename).resolve().relative_to(directory))
    except (OSError, ValueError):
        return None


def users_traceback(error: UserCodeError, directory: Path) -> str:
    """The traceback of what the job's code raised (the cause `error` wraps) as the user wrote it:
    only the frames of files under `directory`, the task's code, named relative to it, and the
    exception's own lines. Empty if `error` wraps no exception (a missing method, a NaN loss)."""
    cause = error.__cause__
    if cause is None:
        return ""
    directory = directory.resolve()
    frames = [
        traceback.FrameSummary(relative, frame.lineno, frame.name, line=frame.line)
        for frame in traceback.extract_tb(cause.__traceback__)
        if (relative := _under(frame.filename, directory)) is not None
    ]
    told = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    return "".join(told + traceback.format_exception_only(type(cause), cause)).rstrip()
