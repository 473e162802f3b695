"""The workload catalogue: every entry validates its defaults, builds, and learns; the catalogue
and the spec import without torch; bad hyperparameters are refused with their field names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.spec import SpecError, validate_spec
from elastic.workloads import CATALOGUE


@pytest.mark.parametrize("module", ["elastic.workloads", "elastic.spec"])
def test_import_does_not_load_torch_or_sklearn(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "loaded = [m for m in ('torch', 'sklearn') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_defaults_validate_and_epoch_size_is_known(name: str) -> None:
    info = CATALOGUE[name]
    spec = validate_spec({"name": "t", "workload": name, "epochs": 1})
    hyperparameters = info.hyperparameters.model_validate(spec.hyperparameters)
    assert spec.hyperparameters == info.hyperparameters.model_validate({}).model_dump()
    assert info.samples_per_epoch(hyperparameters) > hyperparameters.batch_size
    assert spec.total_steps() >= 1
    for field in info.schema()["properties"].values():
        assert field.get("description"), field


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_builds_deterministically_and_loss_falls(name: str) -> None:
    import torch

    from elastic.tasks.runtime import bind_task

    torch.set_num_threads(1)
    info = CATALOGUE[name]
    problem = bind_task(info.path, info.entrypoint, {}, seed=3)
    twin = bind_task(info.path, info.entrypoint, {}, seed=3)
    assert problem.num_samples == info.samples_per_epoch(info.hyperparameters.model_validate({}))
    for mine, theirs in zip(problem.model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)

    optimizer = problem.make_optimizer()
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        indices = torch.randint(0, problem.num_samples, (problem.batch_size,), generator=generator)
        optimizer.zero_grad()
        loss = problem.loss(problem.batch(indices))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses


def _errors(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        validate_spec(data)
    return {error.field: error.message for error in caught.value.errors}


def test_bad_hyperparameters_are_refused_with_their_fields() -> None:
    errors = _errors(
        {
            "name": "t",
            "workload": "digits-mlp",
            "steps": 10,
            "hyperparameters": {"momentum": 1.0, "dropout": -0.1, "hidden": "wide", "depth": 3},
        }
    )
    assert set(errors) == {
        "hyperparameters.momentum",
        "hyperparameters.dropout",
        "hyperparameters.hidden",
        "hyperparameters.depth",
    }


def test_cnn_refuses_zero_channels() -> None:
    errors = _errors({"name": "t", "workload": "digits-cnn", "steps": 10, "hyperparameters": {"channels": 0}})
    assert set(errors) == {"hyperparameters.channels"}


def test_transformer_heads_must_divide_width() -> None:
    errors = _errors(
        {
            "name": "t",
            "workload": "char-transformer",
            "steps": 10,
            "hyperparameters": {"d_model": 30, "heads": 4},
        }
    )
    [message] = errors.values()
    assert "d_model (30)" in message and "heads (4)" in message


def test_transformer_epoch_follows_block_size() -> None:
    info = CATALOGUE["char-transformer"]
    short = info.samples_per_epoch(info.hyperparameters.model_validate({"block_size": 16}))
    long = info.samples_per_epoch(info.hyperparameters.model_validate({"block_size": 64}))
    assert short > 3 * long
