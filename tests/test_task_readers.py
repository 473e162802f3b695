"""A task's items read in reader processes (elastic.tasks.readers, the task's `data_workers`):
an item is what its own seed makes it, whatever the number of readers, the order of reading or
the placement of the virtual workers; strict mode trains bit for bit alike with one reader or
two; the task's error in a reader is the user's error with the reader's traceback. (That readers
die with a SIGKILLed worker, also one still starting: tests/test_reader_shared_memory.py.)"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import default_collate

from elastic.tasks import readers
from elastic.tasks.api import UserCodeError
from elastic.tasks.runtime import BoundTask, bind_task
from elastic.worker.data import SampleStream
from elastic.worker.strict import StrictTrainer
from elastic.worker.trainer import Trainer

NOISY = Path(__file__).parent / "tasks" / "noisy"
SEED = 4



def _bind(tasks: list[BoundTask], entrypoint: str, steps: int | None = None, **hyperparameters: object) -> BoundTask:
    task = bind_task(NOISY, f"task:{entrypoint}", dict(hyperparameters), seed=SEED, steps=steps)
    tasks.append(task)
    return task


def test_an_item_is_what_its_seed_makes_it_whoever_reads_it(bound: list[BoundTask]) -> None:
    # The one reader sizes its data set from the task's `job` (120 points, as the two have): it
    # builds the task for the job as the worker does.
    two, one = _bind(bound, "Noisy"), _bind(bound, "NoisyOneReader", steps=12, points_per_step=10)
    indices, seeds = list(range(0, 40, 3)), [1000 + i for i in range(14)]
    points, labels = two.batch(indices, seeds)
    assert torch.equal(points, one.batch(indices, seeds)[0]) and torch.equal(labels, one.batch(indices, seeds)[1])
    backwards = two.batch(indices[::-1], seeds[::-1])[0]
    assert torch.equal(backwards, points.flip(0)), "an item does not depend on what was read before it"
    assert not torch.equal(two.batch(indices, [s + 1 for s in seeds])[0], points), "the noise follows the seed"
    here = _bind(bound, "NoisyHere")
    here.batch(indices, seeds)
    assert here._readers is None, "data_workers 0 reads in the worker, after the step's own seeding"


def test_a_failure_in_a_reader_is_the_users_error_with_its_traceback(bound: list[BoundTask]) -> None:
    broken = _bind(bound, "Noisy", broken=True)
    broken.batch([1, 2, 3], [1, 2, 3])
    with pytest.raises(UserCodeError, match="in a data reader.* raised KeyError: 'item 13 is broken'") as caught:
        broken.batch([12, 13, 14], [1, 2, 3])
    assert "noisy/task.py" in caught.value.traceback_text and "__getitem__" in caught.value.traceback_text



def test_strict_mode_trains_alike_with_one_reader_or_two(bound: list[BoundTask], group_of_one: None) -> None:
    """Two readers reading each step's items a step ahead, one reading them in the step: the
    same bits."""
    states = []
    for entrypoint in ("Noisy", "NoisyOneReader"):
        task = _bind(bound, entrypoint)
        trainer = StrictTrainer(
            task, task.make_optimizer(), SampleStream(task.num_samples, SEED), 12, SEED, 0, 1, virtual_workers=3
        )
        for step in range(6):
            if entrypoint == "NoisyOneReader":
                trainer.readahead.drop()  # each item read in its step, not ahead
            trainer.step(step, stop_requested=False)
        assert (trainer.readahead.hits > 0) == (entrypoint == "Noisy")
        states.append({k: v.clone() for k, v in task.model.state_dict().items()})
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


def test_plain_mode_reads_on_through_a_resize_that_grows_each_readers_share(bound: list[BoundTask]) -> None:
    """As rank 0 of 2, then alone (a scale-in): each reader's stack doubles, past the shared
    memory lent so far. Two readers and one read the same bytes, so they train the same bits.
    (The sum over ranks is left out: the test is of the reading.)"""
    states = []
    for entrypoint in ("Noisy", "NoisyOneReader"):
        task = _bind(bound, entrypoint)
        trainer = Trainer(task, task.make_optimizer(), SampleStream(task.num_samples, SEED), 24, SEED, 0, 2,
                          reduce=lambda buffer: None)  # fmt: skip
        for step in range(8):
            if step == 4:
                trainer.rebind(0, 1)
            trainer.step(step, stop_requested=False)
        assert task._readers is not None and task._readers._slots._made, "through shared memory"
        states.append({k: v.clone() for k, v in task.model.state_dict().items()})
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


@pytest.mark.parametrize(
    ("entrypoint", "indices"),
    [
        ("Noisy", list(range(0, 40, 3))),  # every share stacks alike: joined in the worker
        ("NoisyMixed", list(range(50, 70))),  # one reader's share of ints, the other's of floats
        ("NoisyMixed", list(range(55, 61)) + list(range(5))),  # one share of both: sent item by item
    ],
)
def test_readers_stack_a_batch_as_the_worker_collates_its_items(
    bound: list[BoundTask], entrypoint: str, indices: list[int]
) -> None:
    """A task collated by torch's default_collate has its readers stack their shares; joined,
    they are the very batch the items collated in the worker make, or, where the shares would
    not join into one stack, that batch is made from the items."""
    task = _bind(bound, entrypoint)
    seeds = [7000 + index for index in indices]
    joined = task.start_reading(indices, seeds)()
    assert task._readers is not None and task._readers.stack
    collated = default_collate(task._readers.read(indices, seeds))
    assert _same(joined, collated)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


_LEAVES = st.one_of(
    st.builds(lambda shape, dtype: torch.arange(math.prod(shape), dtype=dtype).reshape(shape),
              st.lists(st.integers(1, 3), max_size=2).map(tuple), st.sampled_from([torch.float32, torch.int64, torch.uint8])),
    st.builds(lambda n: numpy.arange(n, dtype=numpy.float64), st.integers(1, 3)),
    st.integers(-5, 5), st.floats(-1, 1, allow_nan=False), st.booleans(),
)  # fmt: skip
_ITEMS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, min_size=1, max_size=3).map(tuple), st.lists(inner, min_size=1, max_size=3),
                            st.dictionaries(st.sampled_from("abc"), inner, min_size=1)),  # fmt: skip
    max_leaves=6,
)


@given(item=_ITEMS, count=st.integers(1, 9), cuts=st.lists(st.integers(1, 8), max_size=3), data=st.data())
def test_stacks_of_runs_of_alike_items_join_into_the_stack_of_all(item: object, count: int, cuts: list[int],
                                                                  data: st.DataObject) -> None:  # fmt: skip
    """default_collate of runs of consecutive items of one signature, joined, is default_collate
    of them all, bit for bit (the readers' shares, whatever their sizes)."""
    items = [_varied(item, seed) for seed in range(count)]
    signature = readers._common_signature(items)
    assert signature is not None and signature == readers._signature(item)
    bounds = sorted({0, count, *(cut for cut in cuts if cut < count)})
    parts = [default_collate(items[a:b]) for a, b in itertools.pairwise(bounds)]
    assert _same(readers._joined(parts, pin=False), default_collate(items))


def _varied(value: object, seed: int) -> object:
    """`value` with other contents of the same types and shapes (the item `seed` of a data set)."""
    if isinstance(value, torch.Tensor):
        return value + seed if value.dtype != torch.uint8 else value + (seed % 7)
    if isinstance(value, numpy.ndarray):
        return value * (seed + 1)
    if isinstance(value, bool):
        return bool(seed % 2)
    if isinstance(value, int | float):
        return type(value)(value + seed)
    if isinstance(value, dict):
        return {key: _varied(inner, seed) for key, inner in value.items()}
    assert isinstance(value, list | tuple)
    return type(value)(_varied(inner, seed) for inner in value)


def test_items_that_do_not_stack_alike_have_no_signature_in_common() -> None:
    point = torch.zeros(2)
    assert readers._common_signature([(point, 1), (point, 1.0)]) is None, "an int and a float label"
    assert readers._common_signature([(point, 1), (torch.zeros(3), 1)]) is None, "two shapes"
    assert readers._common_signature([("a", 1), ("b", 1)]) is None, "strings are never stacked in parts"
    assert readers._common_signature([(point, numpy.float32(1))] * 2) is None, "numpy scalars neither"
