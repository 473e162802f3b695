"""A task's data read in worker processes of its own (the task's `data_workers`), for data sets
whose `__getitem__` is slow: decoding, augmenting, reading files.

Each reader process imports the task from its directory, builds it with the job's
hyperparameters (and its `job`, as the worker does) and calls `train_data()` once. A step's items are spread over the readers, and
before reading an item a reader seeds torch's, numpy's and Python's generators with the item's
own seed, which the caller derives from the job's seed and the item's place in the sample stream
(elastic.worker.trainer). So what an item draws (a random crop, noise) does not depend on how
many readers there are, which reader reads it, the number of workers or the resizes: only on
the item. The items come back in order.

A task that leaves collation to torch (no `collate` of its own: torch's default_collate, which
stacks) has each reader stack its share of the items before sending them: the worker then loads
one array per tensor of the batch from each reader and joins them along the batch (Stacked),
rather than unpickling and stacking every item, which was a third of a GPU worker's host time
(128 items of a 3x32x32 image and a label a step on an H100). Joining stacks of consecutive
items is stacking them all, byte for byte, when every item has the same structure, the same
types and the same shapes (_signature): a reader whose items differ sends them one by one, and
if the readers' stacks differ from each other, the whole batch is read again item by item and
collated in the worker (the items are functions of their seeds, so the second read is the first).

The readers are spawned (not forked: the worker has threads and a process group by then), and
each asks Linux to kill it when its worker dies (PR_SET_PDEATHSIG) and also watches its parent
twice a second, so that a SIGKILLed worker leaves none behind."""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import pickle
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils.data import default_collate

from elastic.tasks.api import Job
from elastic.tasks.hyperparameters import validate_hyperparameters
from elastic.tasks.loader import construct_task, load_task_class

_PR_SET_PDEATHSIG = 1
ORPHAN_CHECK_S = 0.5
_dataset: Any = None


def _start(directory: str, entrypoint: str, hyperparameters: dict[str, Any], job: Job | None) -> None:
    """A reader process's start: dies with its parent; builds the task's training data."""
    global _dataset
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # PR_SET_PDEATHSIG follows the parent *thread* and is not portable: a watcher makes sure.
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="parent-watch", daemon=True).start()
    torch.set_num_threads(1)
    task_class = load_task_class(Path(directory), entrypoint)
    _dataset = construct_task(task_class, validate_hyperparameters(task_class, hyperparameters), job).train_data()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


class _Array:
    """A CPU tensor of an item on its way from a reader, as the numpy array of its bytes."""

    __slots__ = ("array",)

    def __init__(self, array: numpy.ndarray) -> None:
        self.array = array

    def __getstate__(self) -> numpy.ndarray:
        return self.array

    def __setstate__(self, array: numpy.ndarray) -> None:
        self.array = array


def _outbound(value: Any) -> Any:
    """`value` with its CPU tensors (in tuples, lists and dicts) as _Array: numpy's pickling
    copies the bytes, where torch's writes a small archive per tensor (128 items of a 3x32x32
    image and a label: 8.4 ms to pickle and 11.5 ms to load, against 1.7 and 0.7 ms). A tensor
    numpy cannot hold (bfloat16, say) or one that needs its autograd travels as torch pickles it."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and not value.requires_grad and value.dtype in _NUMPY_DTYPES:
            return _Array(value.numpy())
        return value
    if type(value) in (tuple, list):
        return type(value)(_outbound(item) for item in value)
    if type(value) is dict:
        return {key: _outbound(item) for key, item in value.items()}
    return value


def _inbound(value: Any) -> Any:
    """The item `_outbound` sent, with its tensors back: the same dtype, shape and bytes."""
    if isinstance(value, _Array):
        array = value.array if value.array.flags.writeable else value.array.copy()
        return torch.from_numpy(array)
    if type(value) in (tuple, list):
        return type(value)(_inbound(item) for item in value)
    if type(value) is dict:
        return {key: _inbound(item) for key, item in value.items()}
    return value


_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.complex64, torch.complex128,
}


def _read_share(indices: Sequence[int], seeds: Sequence[int], stack: bool) -> bytes:
    """A reader's share of a batch: the items, each read right after seeding the generators
    with its own seed, as (their _signature, their stack) when `stack` and they stack alike, else
    (None, the items)."""
    items = []
    for index, seed in zip(indices, seeds, strict=True):
        # The CPU generator alone (a reader has no other device): torch.manual_seed also visits
        # every other device type's generators, 73 against 2 us a call, 9 ms of every 128 items.
        torch.default_generator.manual_seed(seed)
        numpy.random.seed(seed)
        random.seed(seed)
        items.append(_dataset[index])
    signature = _common_signature(items) if stack else None
    payload: Any = items
    if signature is not None:
        try:
            payload = default_collate(items)
        except Exception:  # torch's collation refused what looked stackable: the worker collates
            signature = None
    # Pickled here, as plain bytes: the pool's own pickler would move every tensor through a
    # shared-memory segment of its own (torch.multiprocessing), which cost more than reading
    # small items (64 items of two small tensors: 100-360 ms against 10-40 ms, on 2 loaded cores).
    return pickle.dumps((signature, _outbound(payload)), protocol=pickle.HIGHEST_PROTOCOL)


def _signature(value: Any) -> Any:
    """What decides how default_collate stacks `value` with others, hashable: its structure, and
    each tensor's and array's dtype and shape, each number's type. None for anything else
    (strings, numpy scalars, named tuples, other classes), which is then not stacked in parts."""
    if isinstance(value, torch.Tensor):
        plain = value.layout == torch.strided and not value.requires_grad and value.device.type == "cpu"
        return ("tensor", value.dtype, tuple(value.shape)) if plain else None
    if isinstance(value, numpy.ndarray):
        return ("array", value.dtype.str, value.shape) if value.dtype.kind in "biufc" else None
    if type(value) in (int, float, bool):
        return type(value).__name__
    if type(value) in (tuple, list) and value:
        inner = tuple(_signature(item) for item in value)
        return None if None in inner else ("sequence", inner)
    if type(value) is dict and value:
        fields = tuple((key, _signature(item)) for key, item in value.items())
        return None if any(field is None for _, field in fields) else ("dict", fields)
    return None


def _common_signature(items: list[Any]) -> Any:
    """The items' _signature if they all have the one same, else None."""
    first = _signature(items[0]) if items else None
    return first if first is not None and all(_signature(item) == first for item in items[1:]) else None


def _joined(parts: list[Any], pin: bool) -> Any:
    """default_collate's batches of consecutive runs of items (of one _signature), joined into
    its batch of all of them: tensors concatenated along the batch (into pinned memory if
    `pin`), dicts and lists (default_collate's transposed sequences) field by field."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if len(parts) == 1 and not pin:
            return first
        shape = (sum(len(part) for part in parts), *first.shape[1:])
        return torch.cat(parts, out=torch.empty(shape, dtype=first.dtype, pin_memory=pin))
    if isinstance(first, dict):
        return {key: _joined([part[key] for part in parts], pin) for key in first}
    return [_joined([part[i] for part in parts], pin) for i in range(len(first))]


@dataclass(frozen=True)
class Stacked:
    """A batch as default_collate makes it, stacked in parts by the readers and joined."""

    batch: Any


class PendingRead:
    """The readers' shares of one batch, on their way; dropping it unread cancels the shares
    not begun yet."""

    def __init__(
        self, futures: list[concurrent.futures.Future[bytes]], again: Callable[[], list[Any]], pin: bool
    ) -> None:
        self._futures = futures
        self._again = again
        self._pin = pin

    def result(self) -> Stacked | list[Any]:
        """The batch (Stacked) or its items, in order. Raises what the task's code raised (with
        the reader's traceback as its cause), or BrokenProcessPool if a reader died."""
        shares = [pickle.loads(future.result()) for future in self._futures]
        if not shares:
            return []
        signatures = {signature for signature, _ in shares}
        if None not in signatures and len(signatures) == 1:
            return Stacked(_joined([_inbound(payload) for _, payload in shares], self._pin))
        if signatures == {None}:
            return [_inbound(item) for _, payload in shares for item in payload]
        return self._again()  # stacks of different kinds, or some items stacked and some not

    def __del__(self) -> None:
        for future in self._futures:
            future.cancel()


class ItemReaders:
    """`count` reader processes of the task `entrypoint` in `directory`, built for `job`; `stack`:
    the task collates with torch's default_collate, so the readers stack their shares."""

    def __init__(
        self, count: int, directory: Path, entrypoint: str, hyperparameters: dict[str, Any], job: Job | None,
        stack: bool = False,
    ) -> None:  # fmt: skip
        self.count = count
        self.stack = stack
        self._pool = concurrent.futures.ProcessPoolExecutor(
            count,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(str(directory), entrypoint, hyperparameters, job),
        )

    def read(self, indices: Sequence[int], seeds: Sequence[int]) -> list[Any]:
        """The items `indices`, in order, item i read right after seeding with `seeds[i]`, one
        by one. Raises as PendingRead.result does."""
        read = self._start(indices, seeds, stack=False, pin=False).result()
        assert isinstance(read, list)
        return read

    def start(self, indices: Sequence[int], seeds: Sequence[int], pin: bool = False) -> PendingRead:
        """Hands the items to the readers now, a share of consecutive items each, stacked there
        if `stack` (into pinned memory once joined, if `pin`), and returns them pending."""
        return self._start(indices, seeds, self.stack, pin)

    def _start(self, indices: Sequence[int], seeds: Sequence[int], stack: bool, pin: bool) -> PendingRead:
        share = max(1, -(-len(indices) // self.count))  # one share a reader: a round trip each, side by side
        futures = [
            self._pool.submit(_read_share, indices[at : at + share], seeds[at : at + share], stack)
            for at in range(0, len(indices), share)
        ]
        return PendingRead(futures, lambda: self.read(indices, seeds), pin)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
