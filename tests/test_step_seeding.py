"""A step seeds torch's generators without torch.manual_seed's stack trace on a CPU worker
(elastic.worker.data.seed_torch), and draws what torch.manual_seed would have made it draw."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream, seed_torch
from elastic.worker.strict import StrictTrainer
from elastic.worker.trainer import Trainer

RINGS = Path(__file__).parent / "tasks" / "rings"
BATCH = 24
SEED = 3


def test_a_cpu_step_draws_what_torch_manual_seed_would_give() -> None:
    torch.manual_seed(1234)
    expected = (torch.rand(5), torch.randn(3), torch.bernoulli(torch.full((8,), 0.5)))
    torch.manual_seed(99)  # elsewhere
    seed_torch(1234, torch.device("cpu"))
    got = (torch.rand(5), torch.randn(3), torch.bernoulli(torch.full((8,), 0.5)))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("strict", [False, True])
def test_a_cpu_step_takes_no_stack_trace(strict: bool, group_of_one: None, monkeypatch: pytest.MonkeyPatch) -> None:
    task = bind_task(RINGS, "task:RingsTask", {"batch_size": BATCH, "hidden": 8}, seed=SEED)
    stream = SampleStream(task.num_samples, SEED)
    trainer = (
        StrictTrainer(task, task.make_optimizer(), stream, BATCH, SEED, 0, 1, virtual_workers=4)
        if strict
        else Trainer(task, task.make_optimizer(), stream, BATCH, SEED, 0, 1)
    )
    trainer.step(0, False)

    def refuse(*args: object, **kwargs: object) -> list[str]:
        raise AssertionError("a step took a stack trace (torch.manual_seed's lazy CUDA seeding)")

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process: torch.manual_seed takes no stack trace then")
    monkeypatch.setattr(traceback, "format_stack", refuse)
    for step in range(1, 4):
        trainer.step(step, False)
