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

A reader's stack does not travel through the pool's pipe: the worker lends each share a segment of
shared memory (_Slots), the reader writes the stack's tensors into it and sends only where they
lie, and the worker copies them out once, into the batch (pinned, for a GPU). Through the pipe the
worker copied the bytes four times (the pool's message off the pipe, the pickled bytes in it,
numpy's array, the join): 1.0 ms of its host time a batch of 128 ResNet items on a 2-core VM,
against 0.5 ms (bench/reader_batch.py). A share goes through the
pipe when no segment is lent: the first batch (which tells the segments' size), a stack larger than
the segment, or no shared memory to be had (a full /dev/shm is found when the segment is made, by
reserving its pages: never later, as a reader's SIGBUS). The segments are named
`bungee-readers-<worker pid>-...`; Python's resource tracker, a process the worker starts with
its readers, removes them when the worker and its readers are gone, SIGKILLed included.

The readers are spawned (not forked: the worker has threads and a process group by then), and
each asks Linux to kill it when its worker dies (PR_SET_PDEATHSIG) and also watches its parent
twice a second, so that a SIGKILLed worker leaves none behind."""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import math
import multiprocessing
import os
import pickle
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate

from elastic.tasks.api import Job
from elastic.tasks.hyperparameters import validate_hyperparameters
from elastic.tasks.loader import construct_task, load_task_class

_PR_SET_PDEATHSIG = 1
ORPHAN_CHECK_S = 0.5
SLOT_PREFIX = "bungee-readers-"
"""The names of the shared-memory segments a worker lends its readers start so, then its pid."""
_ALIGN = 64
"""Each tensor of a stack starts at a multiple of this many bytes of its segment."""
_ATTACHED_MAX = 32
"""Segments a reader keeps mapped from share to share (the least recently written is let go)."""
_QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
"""The warnings filter the resource tracker starts with (it takes the worker's -W options). Once a
SIGKILLed worker is gone, the tracker removes the readers' segments and the pool's semaphores and
warns of "leaked" objects, on the worker's stderr, that is the job's log: the cleanup working, read
there as a bug of the job's (seen in the demo as rank 1's last lines)."""
_dataset: Any = None
_attached: collections.OrderedDict[str, SharedMemory] = collections.OrderedDict()


def _start(parent: int, directory: str, entrypoint: str, hyperparameters: dict[str, Any], job: Job | None) -> None:
    """A reader process's start: dies with its parent, the worker `parent`; builds the task's
    training data."""
    global _dataset
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        # The worker died before this reader got here (a reader spawned with the first batch can
        # take seconds to import torch while another reads every share): PR_SET_PDEATHSIG set
        # after its parent's death never fires, and a watcher of the parent of now would watch
        # init. Such a reader outlived a SIGKILLed worker, waiting for work forever.
        os._exit(1)
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


def _read_share(indices: Sequence[int], seeds: Sequence[int], stack: bool, slot: tuple[str, int] | None = None) -> bytes:
    """A reader's share of a batch: the items, each read right after seeding the generators
    with its own seed, as (their _signature, their stack, the bytes the stack takes in a segment,
    whether it is in the segment) when `stack` and they stack alike, else (None, the items, 0,
    False). The stack is written into the lent segment `slot` (its name and size) if it fits, and
    then sent as where its tensors lie."""
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
    needed = 0
    if signature is not None:
        placed, tensors, needed = _layout(payload)
        if slot is not None and needed <= slot[1]:
            _write(slot[0], tensors)
            return pickle.dumps((signature, placed, needed, True), protocol=pickle.HIGHEST_PROTOCOL)
    # Pickled here, as plain bytes: the pool's own pickler would move every tensor through a
    # shared-memory segment of its own (torch.multiprocessing), which cost more than reading
    # small items (64 items of two small tensors: 100-360 ms against 10-40 ms, on 2 loaded cores).
    return pickle.dumps((signature, _outbound(payload), needed, False), protocol=pickle.HIGHEST_PROTOCOL)


class _InSlot:
    """A tensor of a reader's stack, written into the share's segment: where, and what it is."""

    __slots__ = ("offset", "dtype", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __getstate__(self) -> tuple[int, torch.dtype, tuple[int, ...]]:
        return self.offset, self.dtype, self.shape

    def __setstate__(self, state: tuple[int, torch.dtype, tuple[int, ...]]) -> None:
        self.offset, self.dtype, self.shape = state


def _layout(payload: Any) -> tuple[Any, list[tuple[int, torch.Tensor]], int]:
    """default_collate's batch `payload` with each tensor as the _InSlot it would take in a
    segment, the tensors with their offsets, and the bytes they take in all."""
    tensors: list[tuple[int, torch.Tensor]] = []
    end = 0

    def place(value: Any) -> Any:
        nonlocal end
        if not isinstance(value, torch.Tensor):
            return value
        tensors.append((end, value))
        placed = _InSlot(end, value.dtype, tuple(value.shape))
        end += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
        return placed

    return tree_map(place, payload), tensors, end


def _write(name: str, tensors: list[tuple[int, torch.Tensor]]) -> None:
    """Copies `tensors` into the segment `name`, each at its offset (in a reader). Lets go of
    the segments smaller than it: the worker removes those once they are back (a removed
    segment's memory stays taken while a reader maps it)."""
    segment = _attached.pop(name, None) or SharedMemory(name)
    for other in [other for other, kept in _attached.items() if kept.size < segment.size]:
        _attached.pop(other).close()
    _attached[name] = segment  # the most recent last
    while len(_attached) > _ATTACHED_MAX:
        _attached.popitem(last=False)[1].close()
    for offset, tensor in tensors:
        if tensor.numel():
            raw = tensor.contiguous().reshape(-1).view(torch.uint8)
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=raw.numel(), offset=offset).copy_(raw)


def _from_slot(value: Any, segment: SharedMemory) -> Any:
    """The stack `value` (a reader's _layout) with its tensors as views of `segment`: to be copied
    out before the segment is lent again."""

    def view(placed: Any) -> Any:
        if not isinstance(placed, _InSlot):
            return placed
        count = math.prod(placed.shape)
        if not count:
            return torch.empty(placed.shape, dtype=placed.dtype)
        return torch.frombuffer(segment.buf, dtype=placed.dtype, count=count, offset=placed.offset).view(placed.shape)

    return tree_map(view, value)


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


def _joined(parts: list[Any], pin: bool, fresh: bool = False) -> Any:
    """default_collate's batches of consecutive runs of items (of one _signature), joined into
    its batch of all of them: tensors concatenated along the batch (into pinned memory if
    `pin`; always into memory of their own if `fresh`, as views of segments are), dicts and
    lists (default_collate's transposed sequences) field by field."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if len(parts) == 1 and not pin and not fresh:
            return first
        shape = (sum(len(part) for part in parts), *first.shape[1:])
        return torch.cat(parts, out=torch.empty(shape, dtype=first.dtype, pin_memory=pin))
    if isinstance(first, dict):
        return {key: _joined([part[key] for part in parts], pin, fresh) for key in first}
    return [_joined([part[i] for part in parts], pin, fresh) for i in range(len(first))]


@dataclass(frozen=True)
class Stacked:
    """A batch as default_collate makes it, stacked in parts by the readers and joined."""

    batch: Any


class _Slots:
    """The shared-memory segments a worker lends its readers: each to one share at a time, from
    the moment the share is handed to a reader until the worker has copied its stack out (or the
    reader is done with a share that was dropped). All of one size, the largest stack a reader
    has asked for; made on demand, so there are as many as shares on their way at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[SharedMemory] = []
        self._made: list[SharedMemory] = []
        self._size = 0
        self.unavailable: str | None = None
        """Why no segment can be made (shared memory full or missing): the pipe carries all."""

    def take(self) -> SharedMemory | None:
        """A segment to lend, or None (its size is not known yet, or none can be made)."""
        with self._lock:
            if not self._size or self.unavailable:
                return None
            while self._free:
                segment = self._free.pop()
                if segment.size >= self._size:
                    return segment
                self._remove(segment)
            try:
                segment = SharedMemory(f"{SLOT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", create=True, size=self._size)
            except OSError as err:
                self._give_up(err)
                return None
            self._made.append(segment)
            try:  # the pages now, or ENOSPC now: a reader writing past a full /dev/shm dies of SIGBUS
                descriptor = os.open(os.path.join("/dev/shm", segment.name), os.O_RDWR)
                try:
                    os.posix_fallocate(descriptor, 0, self._size)
                finally:
                    os.close(descriptor)
            except FileNotFoundError:
                pass  # not Linux's /dev/shm: nothing to reserve through
            except OSError as err:
                self._give_up(err)
                self._remove(segment)
                return None
            return segment

    def _give_up(self, err: OSError) -> None:
        """No more segments: said once on stderr, which is the job's log in a worker."""
        self.unavailable = f"no shared memory for the readers' stacks ({self._size:,} bytes): {err}"
        print(f"data readers: {self.unavailable}; their batches come through a pipe (slower, the same bytes)",
              file=sys.stderr, flush=True)  # fmt: skip

    def needs(self, size: int) -> None:
        """A reader's stack took `size` bytes: segments made from now on take it."""
        with self._lock:
            self._size = max(self._size, size)

    def give_back(self, segment: SharedMemory) -> None:
        with self._lock:
            if segment in self._made:
                self._free.append(segment)

    def _remove(self, segment: SharedMemory) -> None:
        self._made.remove(segment)
        segment.unlink()
        try:
            segment.close()
        except BufferError:  # a view of it is still alive: closed when it is collected
            pass

    def close(self) -> None:
        """Removes every segment (a reader still writing one keeps its own mapping)."""
        with self._lock:
            for segment in list(self._made):
                self._remove(segment)
            self._free = []


class PendingRead:
    """The readers' shares of one batch, on their way; dropping it unread cancels the shares
    not begun yet."""

    def __init__(
        self, futures: list[concurrent.futures.Future[bytes]], again: Callable[[], list[Any]], pin: bool,
        lent: list[SharedMemory | None] | None = None, slots: _Slots | None = None,
    ) -> None:  # fmt: skip
        self._futures = futures
        self._again = again
        self._pin = pin
        self._lent = lent or [None] * len(futures)
        self._slots = slots

    def result(self) -> Stacked | list[Any]:
        """The batch (Stacked) or its items, in order. Raises what the task's code raised (with
        the reader's traceback as its cause), or BrokenProcessPool if a reader died."""
        try:
            shares = [pickle.loads(future.result()) for future in self._futures]
            if not shares:
                return []
            if self._slots is not None:
                self._slots.needs(max(needed for _, _, needed, _ in shares))
            signatures = {signature for signature, _, _, _ in shares}
            if None not in signatures and len(signatures) == 1:
                parts = [
                    _from_slot(payload, segment) if in_slot and segment is not None else _inbound(payload)
                    for (_, payload, _, in_slot), segment in zip(shares, self._lent, strict=True)
                ]
                return Stacked(_joined(parts, self._pin, fresh=any(in_slot for *_, in_slot in shares)))
            if signatures == {None}:
                return [_inbound(item) for _, payload, _, _ in shares for item in payload]
            return self._again()  # stacks of different kinds, or some items stacked and some not
        finally:
            self._give_back()

    def _give_back(self) -> None:
        """Each lent segment back to the lender once its reader is done with it."""
        lent, self._lent = self._lent, []
        for future, segment in zip(self._futures, lent, strict=False):
            if segment is not None and self._slots is not None:
                future.add_done_callback(functools.partial(_given_back, self._slots, segment))

    def __del__(self) -> None:
        for future in self._futures:
            future.cancel()
        self._give_back()


def _given_back(slots: _Slots, segment: SharedMemory, _: concurrent.futures.Future[bytes]) -> None:
    slots.give_back(segment)


class ItemReaders:
    """`count` reader processes of the task `entrypoint` in `directory`, built for `job`; `stack`:
    the task collates with torch's default_collate, so the readers stack their shares."""

    def __init__(
        self, count: int, directory: Path, entrypoint: str, hyperparameters: dict[str, Any], job: Job | None,
        stack: bool = False,
    ) -> None:  # fmt: skip
        self.count = count
        self.stack = stack
        self._slots = _Slots()
        if _QUIET_TRACKER not in sys.warnoptions:  # read when the pool starts the tracker
            sys.warnoptions.append(_QUIET_TRACKER)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            count,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(os.getpid(), str(directory), entrypoint, hyperparameters, job),
        )

    def read(self, indices: Sequence[int], seeds: Sequence[int]) -> list[Any]:
        """The items `indices`, in order, item i read right after seeding with `seeds[i]`, one
        by one. Raises as PendingRead.result does."""
        read = self._start(indices, seeds, stack=False, pin=False, shared=False).result()
        assert isinstance(read, list)
        return read

    def start(self, indices: Sequence[int], seeds: Sequence[int], pin: bool = False, shared: bool = True) -> PendingRead:
        """Hands the items to the readers now, a share of consecutive items each, stacked there
        if `stack` (into pinned memory once joined, if `pin`), and returns them pending. The
        stacks come through shared memory where they can (`shared`), else through the pipe."""
        return self._start(indices, seeds, self.stack, pin, shared)

    def _start(
        self, indices: Sequence[int], seeds: Sequence[int], stack: bool, pin: bool, shared: bool
    ) -> PendingRead:
        share = max(1, -(-len(indices) // self.count))  # one share a reader: a round trip each, side by side
        starts = range(0, len(indices), share)
        lent = [self._slots.take() if stack and shared else None for _ in starts]
        futures = [
            self._pool.submit(
                _read_share, indices[at : at + share], seeds[at : at + share], stack,
                None if segment is None else (segment.name, segment.size),
            )
            for at, segment in zip(starts, lent, strict=True)
        ]  # fmt: skip
        return PendingRead(futures, lambda: self.read(indices, seeds), pin, lent, self._slots)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._slots.close()
