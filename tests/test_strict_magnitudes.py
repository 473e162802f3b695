"""Strict mode's per-segment magnitudes, from which every worker derives the same fixed-point
scales: on a CPU they come from one min/max pass per segment (torch's multi-tensor inf-norm is a
slow per-tensor loop there), and they must be the very bits of each segment's max |x|, over every
hosted virtual worker's row, with NaN and infinity kept (they are voted on)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.strict import StrictTrainer

RINGS = Path(__file__).parent / "tasks" / "rings"
BATCH = 24
SEED = 3


def _trainer(virtual_workers: int) -> StrictTrainer:
    task = bind_task(RINGS, "task:RingsTask", {"batch_size": BATCH, "hidden": 8}, seed=SEED)
    stream = SampleStream(task.num_samples, SEED)
    return StrictTrainer(task, task.make_optimizer(), stream, BATCH, SEED, 0, 1, virtual_workers=virtual_workers)


def _reference(trainer: StrictTrainer, terms: torch.Tensor) -> torch.Tensor:
    """Each segment's max |x| the slow, obvious way (NaN wins, as in the step's vote)."""
    values = []
    for begin, stop in trainer._bounds:
        segment = terms[:, begin:stop].abs()
        values.append(segment.max() if segment.numel() else torch.zeros((), dtype=terms.dtype))
    return torch.stack(values).to(torch.float64)


@pytest.mark.parametrize("virtual_workers", [1, 3])
def test_cpu_magnitudes_are_each_segments_largest_magnitude(virtual_workers: int) -> None:
    trainer = _trainer(virtual_workers)
    generator = torch.Generator().manual_seed(7)
    terms = torch.randn(virtual_workers, trainer._row_width, generator=generator) * 1e-3
    terms[-1, 2] = -5.0  # a negative entry is the largest magnitude of its segment
    magnitudes = trainer._segment_max_abs(terms)
    assert magnitudes.dtype == torch.float64
    assert torch.equal(magnitudes, _reference(trainer, terms))
    norms = torch.stack(torch._foreach_norm(trainer._segments(terms), math.inf)).to(torch.float64)
    assert torch.equal(magnitudes, norms), "the same bits as the GPU path's inf-norm"


def test_cpu_magnitudes_keep_nan_and_infinity_for_the_vote() -> None:
    trainer = _trainer(3)
    terms = torch.zeros(3, trainer._row_width)
    first_begin, _ = trainer._bounds[0]
    second_begin, _ = trainer._bounds[1]
    terms[1, first_begin] = math.nan
    terms[2, second_begin] = -math.inf
    magnitudes = trainer._segment_max_abs(terms)
    assert math.isnan(magnitudes[0].item())
    assert magnitudes[1].item() == math.inf
    assert torch.equal(magnitudes[2:], torch.zeros(len(trainer._bounds) - 2, dtype=torch.float64))
    assert not bool(torch.isfinite(magnitudes).all())


def test_cpu_magnitudes_are_fresh_each_step() -> None:
    """The min/max scratch is reused; a step with smaller terms must not see the last one's."""
    trainer = _trainer(1)
    large = torch.full((1, trainer._row_width), 4.0)
    small = torch.full((1, trainer._row_width), -0.25)
    trainer._segment_max_abs(large)
    assert torch.equal(trainer._segment_max_abs(small), torch.full((len(trainer._bounds),), 0.25, dtype=torch.float64))
