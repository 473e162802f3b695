"""The next step's items, read while this step computes: the one owner of what is read ahead.

A step's items are known before it starts (the sample stream's positions and the slicing), so
the trainer asks for them a step early:

- a task with reader processes (`data_workers`) gets the next step's items handed to its
  readers as soon as this step's own are in (`start`): they read on other cores while this step
  computes, each item seeded with its own seed, so what they read does not depend on when;
- a task read here has the next step's items read on the main thread once this step's forward
  and backward are queued (`prepare`), which on a GPU is while it computes. They are read with
  torch's CPU generator (and numpy's and Python's) exactly as the step itself would have them:
  seeded as that step seeds them, the draws' end state kept for that step, and the generators
  put back as they were. Never in a thread: a reader thread would race the main thread's
  generator (dropout on the CPU).

Then (`prepare`) the batch is collated (the readers stack a task's items that torch's
default_collate would collate: elastic.tasks.readers) and, on CUDA, put in pinned memory (where
the readers' stacks are joined) and copied with non_blocking on a side stream; the step that
takes it makes its own stream wait for the copy.

What was read ahead is only ever a cache: `batch` hands it over only when it is of the very
items, item seeds and step seed asked for, and when the generators are where that step's
reading would start; anything else (a resize, a switch, a restore, a skipped or failed step
that changes the slicing) drops it and reads afresh. So exactly-once data and strict mode's
bitwise results are those of reading in the step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch.utils._pytree import tree_map

from elastic.tasks.runtime import BoundTask, to_device


@dataclass(frozen=True)
class Share:
    """One batch a step reads: its sample `indices`, the items' own seeds (reader processes),
    the seed of torch's CPU generator the step reads it after (None: unknown, so it is not read
    ahead here), and whether the step seeds numpy's and Python's generators with it too."""

    indices: tuple[int, ...]
    item_seeds: tuple[int, ...] | None
    rng_seed: int | None
    seeds_all: bool = False


@dataclass
class _Ahead:
    share: Share
    collect: Callable[[], Any] | None = None
    """The reader processes' batch, pending (collated on the CPU when called)."""
    batch: Any = None
    error: BaseException | None = None
    before: tuple[Any, Any] | None = None
    """numpy's and Python's generator states the in-process read started from."""
    after: tuple[torch.Tensor, Any, Any] | None = None
    """torch's CPU, numpy's and Python's generator states once the items were read."""
    started: int = 0
    """The call of `start` that asked for it."""
    ready: bool = False
    copied_on: Any = None
    """The CUDA side stream the batch was copied on, if any."""


def _unpinned(value: Any) -> bool:
    """Whether `value` is a CPU tensor outside pinned memory (the readers join theirs there)."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_pinned()


def _states() -> tuple[Any, Any]:
    return numpy.random.get_state(), random.getstate()


def _same_states(left: tuple[Any, Any], right: tuple[Any, Any]) -> bool:
    (lname, lkeys, lpos, lgauss, lcached), lrandom = left
    (rname, rkeys, rpos, rgauss, rcached), rrandom = right
    return (
        lname == rname and lpos == rpos and lgauss == rgauss and lcached == rcached
        and numpy.array_equal(lkeys, rkeys) and lrandom == rrandom
    )


class ReadAhead:
    """Reads the next step's batches of `problem` ahead (one step deep) and hands them over."""

    def __init__(self, problem: BoundTask) -> None:
        self.problem = problem
        self._ahead: list[_Ahead] = []
        self.hits = 0
        """Batches handed over from what was read ahead (for tests and benches)."""
        self._side: Any = None
        self._starts = 0

    def drop(self) -> None:
        """Forgets what was read ahead (the readers' pending items are cancelled)."""
        self._ahead = []

    def start(self, shares: Sequence[Share]) -> None:
        """Reads `shares` (the next step's, in order) ahead: hands them to the reader processes
        at once where the task has them. What the call before asked for and was not taken yet
        is kept (this step's batches still to come, in strict mode); anything older is dropped:
        the read-ahead is one step deep."""
        self._starts += 1
        self._ahead = [ahead for ahead in self._ahead if ahead.started >= self._starts - 1]
        fresh = [_Ahead(share, started=self._starts) for share in shares]
        if self.problem.data_workers:
            for ahead in fresh:
                if ahead.share.indices and ahead.share.item_seeds is not None:
                    ahead.collect = self.problem.start_reading(ahead.share.indices, ahead.share.item_seeds)
        self._ahead.extend(fresh)

    def prepare(self) -> None:
        """Reads (or collects from the readers) and collates the started batches and starts
        their copy to the device. Call it once the step's compute is queued. A read that fails
        keeps its error for the step that asks for the batch."""
        for ahead in self._ahead:
            if ahead.ready or not ahead.share.indices:
                continue
            ahead.ready = True
            try:
                if ahead.collect is not None:
                    batch = ahead.collect()
                elif ahead.share.item_seeds is None and ahead.share.rng_seed is not None:
                    batch = self.problem.collate(self._read_here(ahead))
                else:
                    continue  # nothing known to read it exactly as the step would
                ahead.batch = self._to_device(ahead, batch)
            except Exception as err:  # the task's error (or a dead reader): the step raises it
                ahead.error = err

    def _read_here(self, ahead: _Ahead) -> list[Any]:
        cpu = torch.get_rng_state()
        saved = _states()
        try:
            assert ahead.share.rng_seed is not None
            torch.default_generator.manual_seed(ahead.share.rng_seed)
            if ahead.share.seeds_all:
                numpy.random.seed(ahead.share.rng_seed)
                random.seed(ahead.share.rng_seed)
            ahead.before = _states()
            items = self.problem.read_items(ahead.share.indices)
            ahead.after = (torch.get_rng_state(), *_states())
            return items
        finally:
            torch.set_rng_state(cpu)
            numpy.random.set_state(saved[0])
            random.setstate(saved[1])

    def _to_device(self, ahead: _Ahead, batch: Any) -> Any:
        device = self.problem.device
        if device.type != "cuda":
            return to_device(batch, device)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        ahead.copied_on = self._side
        # Fresh pinned memory and fresh device memory from the side stream's pool: the copy
        # waits for nothing of the step's; the step that takes the batch waits for the copy.
        pinned = tree_map(lambda value: value.pin_memory() if _unpinned(value) else value, batch)
        with torch.cuda.stream(self._side):
            return tree_map(
                lambda value: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value,
                pinned,
            )

    def batch(
        self, indices: torch.Tensor, item_seeds: Sequence[int] | None, rng_seed: int, seeds_all: bool = False
    ) -> Any:
        """The batch of `indices` on the device, the items seeded with `item_seeds` in the
        readers, or read here right after the caller seeded torch's CPU generator (and numpy's
        and Python's if `seeds_all`) with `rng_seed`: the one read ahead if it is of the same
        share, else read now."""
        share = Share(tuple(indices.tolist()), None if item_seeds is None else tuple(item_seeds), rng_seed, seeds_all)
        ahead = self._take(share)
        if ahead is not None and not ahead.ready:
            self._prepare_one(ahead)
        if ahead is None or (ahead.batch is None and ahead.error is None):
            return self.problem.batch(indices, item_seeds)
        if ahead.after is not None:
            assert ahead.before is not None
            if not _same_states(ahead.before, _states()):  # something drew since: read afresh
                return self.problem.batch(indices, item_seeds)
        if ahead.error is not None:
            raise ahead.error
        if ahead.after is not None:
            torch.set_rng_state(ahead.after[0])
            numpy.random.set_state(ahead.after[1])
            random.setstate(ahead.after[2])
        self.hits += 1
        if ahead.copied_on is not None:
            current = torch.cuda.current_stream(self.problem.device)
            current.wait_stream(ahead.copied_on)
            tree_map(lambda value: value.record_stream(current) if isinstance(value, torch.Tensor) else value, ahead.batch)
        return ahead.batch

    def _prepare_one(self, ahead: _Ahead) -> None:
        kept, self._ahead = self._ahead, [ahead]
        try:
            self.prepare()
        finally:
            self._ahead = [other for other in kept if other is not ahead]

    def _take(self, share: Share) -> _Ahead | None:
        for index, ahead in enumerate(self._ahead):
            if ahead.share == share:
                return self._ahead.pop(index)
        return None
