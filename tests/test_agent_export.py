"""The export of a failed job's checkpoint (elastic.worker.export, run by agent.export): once no
worker of the job runs on the node, a real `python -m elastic.worker.export` process builds the
task, loads the checkpoint's model and writes the job's artifacts ("ended": "failed"); the agent
hands them to the uploader. Without a checkpoint on the node there is nothing to hand over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agent.export import CheckpointExporter
from elastic.artifacts import MANIFEST_NAME, MODEL_NAME, Manifest
from elastic.spec import JobSpec
from elastic.tasks.runtime import bind_task
from elastic.wire import ExportCommand, RunningWorker, WorkerEvent
from elastic.worker.checkpoint import TrainingState, checkpoint_path, save_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.trainer import Trainer
from elastic.workloads import CATALOGUE

SPEC: dict[str, Any] = {
    "name": "digits", "workload": "digits-mlp", "steps": 50, "seed": 3,
    "hyperparameters": {"batch_size": 32, "hidden": 16},
}


def checkpoint_of_three_steps(run_dir: Path) -> TrainingState:
    spec = JobSpec(**SPEC)
    info = CATALOGUE["digits-mlp"]
    task = bind_task(info.path, info.entrypoint, SPEC["hyperparameters"], seed=3)
    optimizer = task.make_optimizer()
    trainer = Trainer(task, optimizer, SampleStream(task.num_samples, 3), 32, 3, 0, 1, reduce=lambda buffer: None)
    for step in range(3):
        trainer.step(step, stop_requested=False)
    state = TrainingState(step=3, workload=spec.task_name, seed=3, model=task.model.state_dict(),
                          optimizer=optimizer.state_dict(), trainer=trainer.small_state())
    save_checkpoint(checkpoint_path(run_dir), state)
    return state


def run_export(run_dir: Path, running: list[list[RunningWorker]]) -> list[list[RunningWorker] | WorkerEvent]:
    """Runs an export whose node runs `running` in turn (the last one from then on). Returns what
    happened in order: each answer the exporter was given when it asked what runs, and each event
    it handed over."""
    happened: list[list[RunningWorker] | WorkerEvent] = []

    def running_now() -> list[RunningWorker]:
        workers = running.pop(0) if len(running) > 1 else running[0]
        happened.append(workers)
        return workers

    exporter = CheckpointExporter(running_now, None, happened.append)
    command = ExportCommand(job_id=9, generation=4, spec=SPEC, run_dir=str(run_dir))
    exporter.start(command).join(120)
    return happened


def test_the_checkpoint_is_exported_once_the_jobs_workers_are_gone(tmp_path: Path) -> None:
    state = checkpoint_of_three_steps(tmp_path / "run")
    still_there = RunningWorker(job_id=9, generation=4, rank=0, pid=1, device_index=0)
    *asked, event = run_export(tmp_path / "run", [[still_there], [still_there], []])
    assert asked == [[still_there], [still_there], []], "it exports once the job's worker is gone, not before"
    assert isinstance(event, WorkerEvent)
    assert (event.kind, event.job_id, event.step) == ("artifacts", 9, 3)
    directory = Path(event.message or "")
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert (manifest["ended"], manifest["step"], manifest["job_id"]) == ("failed", 3, 9)
    model = torch.load(directory / MODEL_NAME, weights_only=True)
    assert all(torch.equal(model[name], value) for name, value in state.model.items())
    assert set(manifest["final"]["metrics"]) >= {"accuracy"}
    assert Manifest.model_validate(manifest).stored() == manifest, "the portal takes the manifest a worker writes"

    [nothing_runs, again] = run_export(tmp_path / "run", [[]])
    assert nothing_runs == [] and isinstance(again, WorkerEvent)
    assert again.message == event.message, "what is there already is named, not written again"


def test_a_node_without_the_checkpoint_hands_over_nothing(tmp_path: Path) -> None:
    assert run_export(tmp_path / "elsewhere", [[]]) == [[]], "asked once what runs; nothing handed over"
