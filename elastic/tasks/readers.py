"""A task's data read in worker processes of its own (the task's `data_workers`), for data sets
whose `__getitem__` is slow: decoding, augmenting, reading files.

Each reader process imports the task from its directory, builds it with the job's
hyperparameters (and its `job`, as the worker does) and calls `train_data()` once. A step's items are spread over the readers, and
before reading an item a reader seeds torch's, numpy's and Python's generators with the item's
own seed, which the caller derives from the job's seed and the item's place in the sample stream
(elastic.worker.trainer). So what an item draws (a random crop, noise) does not depend on how
many readers there are, which reader reads it, the number of workers or the resizes: only on
the item. The items come back in order and are collated in the worker.

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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

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


def _read(index: int, seed: int) -> bytes:
    # The CPU generator alone (a reader has no other device): torch.manual_seed also visits every
    # other device type's generators, 73 against 2 us a call, 9 ms of every 128 items.
    torch.default_generator.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)
    # Pickled here, as plain bytes: the pool's own pickler would move every tensor through a
    # shared-memory segment of its own (torch.multiprocessing), which cost more than reading
    # small items (64 items of two small tensors: 100-360 ms against 10-40 ms, on 2 loaded cores).
    return pickle.dumps(_outbound(_dataset[index]), protocol=pickle.HIGHEST_PROTOCOL)


def _received(data: bytes) -> Any:
    return _inbound(pickle.loads(data))


class ItemReaders:
    """`count` reader processes of the task `entrypoint` in `directory`, built for `job`."""

    def __init__(
        self, count: int, directory: Path, entrypoint: str, hyperparameters: dict[str, Any], job: Job | None
    ) -> None:
        self.count = count
        self._pool = concurrent.futures.ProcessPoolExecutor(
            count,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(str(directory), entrypoint, hyperparameters, job),
        )

    def read(self, indices: Sequence[int], seeds: Sequence[int]) -> list[Any]:
        """The items `indices`, in order, item i read right after seeding with `seeds[i]`.
        Raises what the task's code raised (with the reader's traceback as its cause), or
        concurrent.futures.process.BrokenProcessPool if a reader died."""
        return list(self.start(indices, seeds))

    def start(self, indices: Sequence[int], seeds: Sequence[int]) -> Iterator[Any]:
        """Hands the items to the readers now and returns an iterator over them, in order, that
        waits for each (raising as `read` does); dropping it cancels the items not read yet."""
        chunk = max(1, -(-len(indices) // self.count))  # one task a reader: a round trip each, side by side
        return map(_received, self._pool.map(_read, indices, seeds, chunksize=chunk))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
