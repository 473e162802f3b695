"""Strict mode's predicted scales: after a step that took the MAX all-reduce, the next steps try
its scales, loosened by a margin, without it; the SUM all-reduce carries every rank's votes, and
a step whose terms left the predicted range falls back to the MAX all-reduce and gives exactly
what that path gives. The scales are state: they travel in the small state (to joiners and
checkpoints), so that a resized or resumed run predicts as the fixed run does (the multi-process
bitwise tests, tests/test_worker_strict_consistency.py, run through all of this). So is the
switch from int32 to int64 of a job whose int32 predictions are rejected too often."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.strict import MAX_SCALE_MARGIN_BITS, WIDEN_AFTER_REJECTIONS, WIDEN_WINDOW, StrictTrainer

RINGS = Path(__file__).parent / "tasks" / "rings"
NOISY = Path(__file__).parent / "tasks" / "noisy"
BATCH = 24
SEED = 3


def _trainer(virtual_workers: int = 2) -> StrictTrainer:
    task = bind_task(RINGS, "task:RingsTask", {"batch_size": BATCH, "hidden": 8}, seed=SEED)
    stream = SampleStream(task.num_samples, SEED)
    return StrictTrainer(task, task.make_optimizer(), stream, BATCH, SEED, 0, 1, virtual_workers=virtual_workers)


def _parameters(trainer: StrictTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.problem.model.parameters()]


def test_a_step_predicts_the_next_ones_scales_and_they_hold(group_of_one: None) -> None:
    trainer = _trainer()
    assert trainer.predicted_scales is None
    trainer.step(0, False)
    first = trainer.predicted_scales
    assert first is not None and len(first) == len(trainer._bounds)
    assert all(scale > 0 and float(scale).hex().startswith(("0x1.0000000000000p", "0x1p")) for scale in first)
    for step in range(1, 8):
        trainer.step(step, False)
    assert trainer.scale_fallbacks < 7, "the predictions held for some steps"


def test_a_rejected_prediction_gives_exactly_the_max_all_reduces_step(group_of_one: None) -> None:
    trainer = _trainer()
    trainer.step(0, False)
    reference = copy.deepcopy(trainer)
    reference.predicted_scales = None  # the MAX all-reduce's path
    for wrong in (2.0**60, 2.0**-60):  # every term over the range; every term far below the floor
        mispredicted = copy.deepcopy(trainer)
        assert mispredicted.predicted_scales is not None
        mispredicted.predicted_scales = [wrong] * len(mispredicted.predicted_scales)
        expected = copy.deepcopy(reference)
        loss = expected.step(1, False).loss
        fallbacks = mispredicted.scale_fallbacks
        outcome = mispredicted.step(1, False)
        assert mispredicted.scale_fallbacks == fallbacks + 1
        assert outcome.loss == loss
        assert all(
            torch.equal(a, b) for a, b in zip(_parameters(mispredicted), _parameters(expected), strict=True)
        )
        assert mispredicted.predicted_scales == expected.predicted_scales, "re-predicted from the MAX"


def test_the_scales_travel_in_the_small_state(group_of_one: None) -> None:
    holder = _trainer()
    for step in range(3):
        holder.step(step, False)
    joiner = _trainer()
    joiner.problem.model.load_state_dict(holder.problem.model.state_dict())
    joiner.optimizer.load_state_dict(copy.deepcopy(holder.optimizer.state_dict()))  # not aliased
    for mine, theirs in zip(joiner.bulk_state(), holder.bulk_state(), strict=True):
        mine.copy_(theirs)
    joiner.load_small_state(copy.deepcopy(holder.small_state()))
    joiner.state_arrived()
    assert joiner.predicted_scales == holder.predicted_scales
    holder.step(3, False)
    joiner.step(3, False)
    assert all(torch.equal(a, b) for a, b in zip(_parameters(joiner), _parameters(holder), strict=True))
    old = holder.small_state()
    del old["predicted_scales"]  # a checkpoint written before the scales were predicted
    joiner.load_small_state(old)
    assert joiner.predicted_scales is None


def test_many_virtual_workers_in_int32_take_the_max_all_reduce_every_step(group_of_one: None) -> None:
    """With 9 to 32 virtual workers int32 keeps 24 or 25 bits: no margin to predict in."""
    trainer = _trainer(virtual_workers=12)
    for step in range(2):
        trainer.step(step, False)
    assert trainer.predicted_scales is None


def test_half_the_last_predictions_rejected_move_an_int32_job_to_int64(group_of_one: None) -> None:
    """The rule alone, fed outcomes: rejections that the window never holds enough of leave
    int32; the one that makes WIDEN_AFTER_REJECTIONS within it switches to int64 for good, with
    no prediction (the next step takes the MAX all-reduce for int64's scales) and a fresh
    count."""
    trainer = _trainer(virtual_workers=3)
    trainer.step(0, False)
    assert trainer.fixed_dtype == torch.int32 and trainer.predicted_scales is not None
    for _ in range(3):  # one rejection in every window
        for rejected in [True] + [False] * (WIDEN_WINDOW - 1):
            trainer._count_prediction(rejected)
    for _ in range(WIDEN_AFTER_REJECTIONS - 1):
        trainer._count_prediction(True)
    assert trainer.fixed_dtype == torch.int32, "one rejection short"
    trainer._count_prediction(True)
    assert trainer.fixed_dtype == torch.int64 and trainer._total.dtype == torch.int64
    assert trainer.predicted_scales is None and trainer.recent_rejections == []
    assert trainer.wide_fixed_point and trainer._margin_bits == MAX_SCALE_MARGIN_BITS
    for _ in range(WIDEN_WINDOW):
        trainer._count_prediction(True)
    assert trainer.fixed_dtype == torch.int64, "never back to int32"
    for step in range(1, 4):  # trains on in int64, predicting again after one MAX step
        trainer.step(step, False)
    assert trainer.predicted_scales is not None


def test_predictions_int32_cannot_hold_stop_failing_once_the_job_sums_in_int64(group_of_one: None) -> None:
    """The noisy task's magnitudes jump by up to 6 bits from one step to the next with 3
    virtual workers of 4 samples: int32's one-bit margin rejected 13 of 15 predictions (26 of
    30 at this batch). The job switches to int64 at its WIDEN_AFTER_REJECTIONS-th rejection
    within WIDEN_WINDOW predicted steps, and int64's 8-bit margin holds (each segment spanned
    at most 7 bits over 30 steps): at most WIDEN_AFTER_REJECTIONS + 1 fallbacks (one for a
    first rejection that the window lets go before the switch)."""
    task = bind_task(NOISY, "task:NoisyMetrics", {}, seed=6)
    try:
        trainer = StrictTrainer(
            task, task.make_optimizer(), SampleStream(task.num_samples, 6), 12, 6, 0, 1, virtual_workers=3
        )
        for step in range(16):
            trainer.step(step, False)
    finally:
        task.close()
    assert trainer.fixed_dtype == torch.int64
    assert trainer.scale_fallbacks <= WIDEN_AFTER_REJECTIONS + 1, trainer.scale_fallbacks


def test_the_fixed_point_travels_in_the_small_state(group_of_one: None) -> None:
    holder = _trainer(virtual_workers=3)
    holder.step(0, False)
    for _ in range(WIDEN_AFTER_REJECTIONS):
        holder._count_prediction(True)
    for step in range(1, 3):
        holder.step(step, False)
    assert holder.fixed_dtype == torch.int64
    joiner = _trainer(virtual_workers=3)
    joiner.problem.model.load_state_dict(holder.problem.model.state_dict())
    joiner.optimizer.load_state_dict(copy.deepcopy(holder.optimizer.state_dict()))
    for mine, theirs in zip(joiner.bulk_state(), holder.bulk_state(), strict=True):
        mine.copy_(theirs)
    joiner.load_small_state(copy.deepcopy(holder.small_state()))
    joiner.state_arrived()
    assert joiner.fixed_dtype == torch.int64 and joiner.recent_rejections == holder.recent_rejections
    for step in range(3, 5):
        assert joiner.step(step, False).loss == holder.step(step, False).loss
    assert all(torch.equal(a, b) for a, b in zip(_parameters(joiner), _parameters(holder), strict=True))
    old = holder.small_state()
    del old["wide_fixed_point"], old["recent_rejections"]  # a checkpoint from before the switch
    joiner.load_small_state(old)
    assert joiner.fixed_dtype == torch.int32 and joiner.recent_rejections == []
