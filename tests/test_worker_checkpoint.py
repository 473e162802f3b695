"""The checkpoint: a save replaces the file atomically and reads back equal; a checkpoint of
another job is refused with what does not match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.worker.checkpoint import (
    CheckpointError,
    TrainingState,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)


def _state(step: int) -> TrainingState:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return TrainingState(step, "digits-mlp", 4, model.state_dict(), optimizer.state_dict())


def test_save_then_load_round_trips_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path / "run")
    assert load_checkpoint(path) is None
    save_checkpoint(path, _state(3))
    state = _state(9)
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded is not None and loaded.step == 9
    for name, tensor in state.model.items():
        assert torch.equal(loaded.model[name], tensor)
    assert loaded.optimizer["state"][0]["momentum_buffer"].equal(
        state.optimizer["state"][0]["momentum_buffer"]
    )
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_checkpoint_of_another_job_is_refused() -> None:
    state = _state(3)
    state.check_belongs_to("digits-mlp", 4, total_steps=3)
    with pytest.raises(CheckpointError, match="'digits-cnn' seed 4"):
        state.check_belongs_to("digits-cnn", 4, total_steps=10)
    with pytest.raises(CheckpointError, match="step 3, the job has 2 steps"):
        state.check_belongs_to("digits-mlp", 4, total_steps=2)


def test_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 3}, path)
    with pytest.raises(CheckpointError, match="format_version is None"):
        load_checkpoint(path)
