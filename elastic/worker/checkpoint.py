"""The job's periodic checkpoint: the training state after a completed step, in one file in the
run directory. It is kept for one case only, every worker of the job lost at once: resizes and
single deaths move the state between workers' memories (elastic.worker.transfer). Only rank 0
reads or writes it; what it read reaches the other ranks over the process group, so that nodes
share no disk. A write goes to a temporary file that then replaces
the checkpoint, so a crash mid-write leaves the previous checkpoint intact.

The state holds no RNG state: the worker reseeds its generators at every step from (job seed,
step, rank or virtual worker), and the data order is a function of the step (hybrid mode: of the
stream position, which the consistency mode's state holds), so the step count restores both."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint exists but does not belong to this job or cannot be used."""


@dataclass
class TrainingState:
    """Everything needed to continue after step `step` (the count of completed steps)."""

    step: int
    workload: str
    seed: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    """The consistency mode's small values (Trainer.small_state)."""
    trainer_tensors: list[torch.Tensor] = field(default_factory=list)
    """The consistency mode's own tensors (Trainer.bulk_state), such as strict mode's
    per-virtual-worker contexts."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "workload": self.workload,
            "seed": self.seed,
            "model": self.model,
            "optimizer": self.optimizer,
            "trainer": self.trainer,
            "trainer_tensors": self.trainer_tensors,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingState:
        """Raises CheckpointError if `data` is not a checkpoint of this format."""
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format_version is {version!r}, this worker reads {FORMAT_VERSION}"
            )
        return cls(
            step=data["step"],
            workload=data["workload"],
            seed=data["seed"],
            model=data["model"],
            optimizer=data["optimizer"],
            trainer=data.get("trainer", {}),
            trainer_tensors=data.get("trainer_tensors", []),
        )

    def check_belongs_to(self, workload: str, seed: int, total_steps: int) -> None:
        """Raises CheckpointError if this state is not from a run of `workload` with `seed`, or
        is past `total_steps`."""
        if self.workload != workload or self.seed != seed:
            raise CheckpointError(
                f"checkpoint is of workload {self.workload!r} seed {self.seed}, "
                f"the job is {workload!r} seed {seed}"
            )
        if not 0 <= self.step <= total_steps:
            raise CheckpointError(f"checkpoint is at step {self.step}, the job has {total_steps} steps")


def checkpoint_path(run_dir: str | Path) -> Path:
    """Return where the checkpoint of the job whose run directory is `run_dir` lives."""
    return Path(run_dir) / CHECKPOINT_NAME


def save_checkpoint(path: Path, state: TrainingState) -> None:
    """Write `state` to `path` atomically, creating the directory if needed. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state.to_dict(), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def load_checkpoint(path: Path) -> TrainingState | None:
    """Return the state saved at `path` (tensors on CPU), or None if there is no file.

    Raises CheckpointError if the file is not a checkpoint of this format.
    """
    if not path.exists():
        return None
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a checkpoint")
    return TrainingState.from_dict(data)
