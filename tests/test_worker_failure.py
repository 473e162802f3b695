"""Failures end a worker with FAILED_EXIT_CODE and a traceback on stderr rather than a hang: a
checkpoint of another job in the run directory, and a peer that dies mid-run, after which the
periodic checkpoint is what is left."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from elastic.worker import FAILED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, checkpoint_path, load_checkpoint, save_checkpoint
from elastic.worker.local import LocalWorkers

pytestmark = pytest.mark.slow

SPEC = {"name": "failure", "workload": "digits-mlp", "steps": 100_000}


def test_checkpoint_of_another_workload_fails_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = torch.nn.Linear(2, 2)
    foreign = TrainingState(5, "digits-cnn", 0, model.state_dict(), {"state": {}, "param_groups": []})
    save_checkpoint(checkpoint_path(tmp_path), foreign)
    with LocalWorkers(SPEC, world_size=1, run_dir=tmp_path) as workers:
        outputs = workers.wait()
    for output in outputs:
        assert output.returncode == FAILED_EXIT_CODE
        assert "Traceback" in output.stderr
        assert "CheckpointError: checkpoint is of workload 'digits-cnn' seed 0" in output.stderr


def test_a_peer_killed_mid_run_fails_the_survivor_and_leaves_the_periodic_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("BUNGEE_PG_TIMEOUT_S", "20")
    monkeypatch.setenv("BUNGEE_CHECKPOINT_EVERY_S", "0.05")
    monkeypatch.setenv("BUNGEE_PROGRESS_EVERY_S", "0.2")
    with LocalWorkers(SPEC, world_size=2, run_dir=tmp_path) as workers:
        workers.wait_for(0, lambda event: event.kind == "progress" and (event.step or 0) > 1)
        workers.send_signal(1, signal.SIGKILL)
        leader, follower = workers.wait(timeout_s=60)
    assert follower.returncode == -signal.SIGKILL
    assert leader.returncode == FAILED_EXIT_CODE
    assert "Traceback" in leader.stderr
    saved = load_checkpoint(checkpoint_path(tmp_path))
    assert saved is not None and saved.step >= 1
