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
    segments = [terms[:, begin:stop] for begin, stop in trainer._bounds]  # every row's
    norms = torch.stack(torch._foreach_norm(segments, math.inf)).to(torch.float64)
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


def _shared(trainer: StrictTrainer, terms: torch.Tensor, shares: list[float]) -> torch.Tensor:
    """The terms with each row's gradient segments times its share, as a separate pass would."""
    gradients = trainer._bounds[len(trainer._parameters) - 1][1]
    shared = terms.clone()
    for row, share in enumerate(shares):
        shared[row, :gradients].mul_(share)
    return shared


@pytest.mark.parametrize("shares", [[1 / 3] * 3, [7 / 24, 9 / 24, 8 / 24], [0.5, 0.5, 0.0]])
def test_magnitudes_with_shares_are_those_of_the_shared_terms(shares: list[float]) -> None:
    """The share is applied with the scale, after the magnitudes: they must be the bits a
    separate pass over the shared terms would give (rounding is monotonic)."""
    trainer = _trainer(3)
    generator = torch.Generator().manual_seed(11)
    terms = torch.randn(3, trainer._row_width, generator=generator) * 3e-3
    terms[1, 5] = -7.25
    magnitudes = trainer._segment_max_abs(terms, shares)
    assert torch.equal(magnitudes, _reference(trainer, _shared(trainer, terms, shares)))


@pytest.mark.parametrize("fixed", [torch.int32, torch.int64])
def test_fixed_point_of_share_and_scale_in_one_pass_is_that_of_two(fixed: torch.dtype) -> None:
    """One multiplication by share x scale gives the integers that multiplying by the share,
    then by the (power-of-two) scale, gives; and the conversion truncates toward zero."""
    trainer = _trainer(3)
    trainer._fixed = fixed
    shares = [7 / 24, 9 / 24, 8 / 24]
    generator = torch.Generator().manual_seed(13)
    terms = torch.randn(3, trainer._row_width, generator=generator) * 1e-2
    scales = [2.0 ** (20 + i % 5) for i in range(len(trainer._bounds))]
    expected = torch.zeros(trainer._row_width, dtype=fixed)
    for row in _shared(trainer, terms, shares):
        scaled = torch.cat([segment * scale for segment, scale in zip(trainer._segments(row), scales, strict=True)])
        expected += torch.trunc(scaled).to(fixed)
    into = torch.zeros(trainer._row_width, dtype=fixed)
    trainer._to_fixed(terms.clone(), scales, shares, into)
    assert torch.equal(into, expected)
