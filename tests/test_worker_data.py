"""The worker's data order: shares split a batch evenly and contiguously, the stream crosses
epochs without skipping or repeating a sample, and it depends on nothing but the step."""

from __future__ import annotations

import pytest
import torch

from elastic.worker.data import SampleStream, epoch_permutation, share_bounds


@pytest.mark.parametrize(("count", "world_size"), [(64, 2), (5, 2), (7, 3), (2, 3), (1, 4), (9, 9)])
def test_shares_cover_the_batch_contiguously_and_evenly(count: int, world_size: int) -> None:
    bounds = [share_bounds(count, world_size, rank) for rank in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_share_of_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank \(2\)"):
        share_bounds(8, 2, 2)


def test_every_epoch_is_a_permutation_and_epochs_differ() -> None:
    first, second = epoch_permutation(7, 0, 100), epoch_permutation(7, 1, 100)
    assert sorted(first.tolist()) == list(range(100))
    assert not torch.equal(first, second)
    assert torch.equal(first, epoch_permutation(7, 0, 100))
    assert not torch.equal(first, epoch_permutation(8, 0, 100))


@pytest.mark.parametrize("batch_size", [1, 7, 10, 23, 45])
def test_batches_cross_epochs_without_skipping_or_repeating(batch_size: int) -> None:
    samples, epochs = 10 * 3 + 1, 3
    stream = SampleStream(samples, seed=5)
    steps = epochs * samples // batch_size
    flat = torch.cat([stream.global_batch(step, batch_size) for step in range(steps)]).tolist()
    for epoch in range(len(flat) // samples):
        assert sorted(flat[epoch * samples : (epoch + 1) * samples]) == list(range(samples))
    expected = torch.cat([epoch_permutation(5, e, samples) for e in range(epochs + 1)])
    assert flat == expected[: len(flat)].tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_local_batches_concatenate_to_the_global_batch(world_size: int) -> None:
    stream, fresh = SampleStream(50, seed=1), SampleStream(50, seed=1)
    for step in (0, 6, 7, 30):
        local = [stream.local_batch(step, 7, world_size, rank) for rank in range(world_size)]
        assert torch.equal(torch.cat(local), fresh.global_batch(step, 7))


def test_a_stream_answers_any_step_in_any_order() -> None:
    forward, backward = SampleStream(13, seed=2), SampleStream(13, seed=2)
    steps = list(range(20))
    ahead = {step: forward.global_batch(step, 4) for step in steps}
    for step in reversed(steps):
        assert torch.equal(backward.global_batch(step, 4), ahead[step])
