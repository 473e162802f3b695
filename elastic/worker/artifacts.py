"""What a job leaves its owner: rank 0 writes it when the job completes, when its workers are
told to stop (a cancel), or when the job's code fails after steps were trained (the state of
the last completed step), in `<run_dir>/artifacts`, then says so with an "artifacts" event; the agent
hands the files to the portal, which keeps them after the nodes are gone.

    model.pt        the final model as a plain state dict: torch.load(..., weights_only=True)
                    loads it into the task's own model class, without Bungee installed. In strict
                    mode its buffers (batch-norm statistics) are virtual worker 0's, so the file is
                    the same however the job was resized.
    checkpoint.pt   the whole training state (elastic.worker.checkpoint), to go on from.
    manifest.json   the spec, the code's digest and entrypoint (or the workload), the steps, the
                    final loss and the task's evaluation metrics, the sha256 of each file, the
                    versions of Bungee and torch, and what it was trained with (`environment`:
                    the node's Python and torch build, and the job's own packages, if any: its
                    requirements as given and every package installed, with its version).

The evaluation metrics are those of `evaluate` over the task's `eval_data`, in batches of the
global batch size taken in order, each batch's metrics weighted by its size, with the model in
eval mode: reloading model.pt and doing the same gives the same numbers."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from elastic import __version__
from elastic.artifacts import (
    ARTIFACTS_DIR,
    CHECKPOINT_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    SHORT_TEXT_CHARS,
    artifacts_dir,
)
from elastic.codepack import file_digest
from elastic.spec import JobSpec
from elastic.tasks.api import UserCodeError
from elastic.tasks.runtime import BoundTask
from elastic.wire import OWN_PACKAGES_FILE, OwnPackages
from elastic.worker.events import EventWriter, finite_only
from elastic.worker.trainer import Trainer


def trained_with() -> dict[str, Any]:
    """The manifest's `environment` (elastic.artifacts.TrainedWith): this interpreter's Python,
    its torch build, and the job's own packages where this interpreter is that of a job's own
    environment (the record its build left at its top, elastic.wire.OWN_PACKAGES_FILE); None
    where it is the node's."""
    try:
        own = OwnPackages.model_validate_json((Path(sys.prefix) / OWN_PACKAGES_FILE).read_bytes())
    except (OSError, ValueError):
        own = None
    return {
        "python": sys.version[:SHORT_TEXT_CHARS],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "own_packages": own.model_dump(mode="json") if own is not None else None,
    }


class ArtifactExporter:
    """Rank 0's evaluations of the task, and its export of the job's model, checkpoint and
    manifest at the end (see the module)."""

    def __init__(
        self,
        run_dir: str | Path,
        job_id: int,
        spec: JobSpec,
        problem: BoundTask,
        trainer: Trainer | None,
        checkpoint: Path,
        events: EventWriter,
    ) -> None:
        """`trainer` None: the model's state is the task's model's as it is (an export from the
        checkpoint, elastic.worker.export)."""
        self.directory = artifacts_dir(run_dir)
        self.job_id = job_id
        self.spec = spec
        self.problem = problem
        self.trainer = trainer
        self.checkpoint = checkpoint
        self.events = events

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluates the task after `step` steps, reports it (an "evaluation" event) and returns
        the metrics; none, with a log line, if the task's evaluation raises."""
        try:
            metrics = finite_only(self.problem.evaluate()) or {}
        except UserCodeError as err:
            self.events.log(f"the evaluation after step {step} failed: {err}")
            return {}
        if metrics:
            self.events.emit("evaluation", step=step, metrics=metrics)
        return metrics

    def export(self, step: int, ended: str, loss: float | None) -> None:
        """Writes the artifacts of the state after `step` steps (`ended`: "completed", "stopped"
        or "failed") and emits the "artifacts" event. A failure to write is logged, not raised:
        the job's end must not hang on it; an evaluation that raises is logged and left out."""
        try:
            self._export(step, ended, loss)
        except OSError as err:
            self.events.log(f"could not write the job's artifacts: {err}")

    def _export(self, step: int, ended: str, loss: float | None) -> None:
        staging = self.directory.with_name(ARTIFACTS_DIR + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if self.trainer is not None:
            model_state = self.trainer.exported_model_state()
        else:
            model_state = {name: value.detach().to("cpu", copy=True) for name, value in self.problem.model.state_dict().items()}
        torch.save(model_state, staging / MODEL_NAME)
        shutil.copyfile(self.checkpoint, staging / CHECKPOINT_NAME)
        metrics = self.evaluate(step)
        manifest: dict[str, Any] = {
            "job_id": self.job_id,
            "ended": ended,
            "step": step,
            "total_steps": self.spec.total_steps(),
            "world_size": self.trainer.world_size if self.trainer is not None else None,
            "spec": self.spec.model_dump(mode="json"),
            "task": {"workload": self.spec.workload, "code": self.spec.code, "entrypoint": self.spec.entrypoint},
            "final": {"loss": loss, "metrics": metrics, "evaluated_with_batch_size": self.problem.batch_size},
            "files": {name: file_digest(staging / name) for name in (MODEL_NAME, CHECKPOINT_NAME)},
            "bungee_version": __version__,
            "torch_version": torch.__version__,
            "created_at": time.time(),
            "environment": trained_with(),
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(self.directory, ignore_errors=True)
        os.replace(staging, self.directory)
        self.events.emit("artifacts", step=step, message=str(self.directory))
