"""`python -m elastic.worker.export`: the artifacts of a job that ended failed, written from its
periodic checkpoint by the agent of the node that holds it (elastic.wire.ExportCommand), when no
worker could write them: restarts used up, or a failure that left rank 0 waiting on its peers.

The configuration comes as an elastic.wire.ExportConfig, JSON in BUNGEE_EXPORT_CONFIG. The process builds the task on the CPU,
loads the checkpoint's model into it and exports as rank 0 does (elastic.worker.artifacts), with
"ended": "failed" and no final loss; its stdout carries the worker events (an "artifacts" event
at the end). If artifacts as new as the checkpoint are already there (rank 0 wrote them before it
failed), it names those instead. Exit codes: 0 exported, 3 no checkpoint here, 1 failed."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from elastic.artifacts import MANIFEST_NAME, artifacts_dir
from elastic.spec import JobSpec
from elastic.tasks.loader import load_task_class
from elastic.tasks.runtime import BoundTask
from elastic.wire import ExportConfig
from elastic.worker import EXPORT_CONFIG_ENV
from elastic.worker.artifacts import ArtifactExporter
from elastic.worker.checkpoint import checkpoint_path, load_checkpoint
from elastic.worker.events import EventWriter
from elastic.workloads import CATALOGUE

NO_CHECKPOINT_EXIT_CODE = 3


def export(config: ExportConfig, events: EventWriter) -> int:
    """Exports the job's checkpoint; returns the exit code. Raises on a failure."""
    spec = JobSpec(**config.spec)
    run_dir = Path(config.run_dir)
    state = load_checkpoint(checkpoint_path(run_dir))
    if state is None:
        events.log(f"no checkpoint of job {config.job_id} in {run_dir} on this node: nothing to export")
        return NO_CHECKPOINT_EXIT_CODE
    state.check_belongs_to(spec.task_name, spec.seed, spec.total_steps())
    written = artifacts_dir(run_dir) / MANIFEST_NAME
    if written.exists() and json.loads(written.read_text()).get("step", -1) >= state.step:
        events.emit("artifacts", step=state.step, message=str(written.parent))
        return 0
    if config.code_dir:
        source = (Path(config.code_dir), str(config.entrypoint))
    else:
        info = CATALOGUE[str(spec.workload)]
        source = (info.path, info.entrypoint)
    torch.set_num_threads(1)
    problem = BoundTask(
        load_task_class(*source), spec.hyperparameters, spec.seed, torch.device("cpu"), source, steps=spec.total_steps()
    )
    problem.model.load_state_dict(state.model)
    exporter = ArtifactExporter(
        run_dir, config.job_id, spec, problem, None, checkpoint_path(run_dir), events
    )
    exporter.export(state.step, "failed", None)
    events.log(f"exported the state of step {state.step} from the checkpoint, after the job failed")
    return 0


def main() -> int:
    try:
        config = ExportConfig.model_validate_json(os.environ[EXPORT_CONFIG_ENV])
        events = EventWriter.for_job(config.job_id, config.generation)
        return export(config, events)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
