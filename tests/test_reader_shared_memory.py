"""A reader's stack comes to the worker through a segment of shared memory the worker lends it
(elastic.tasks.readers._Slots), not through the pool's pipe: the same bytes as the pipe and as
the items collated in the worker; each segment lent to one share at a time and back once its
reader is done, also for a read dropped unread; the pipe when no segment can be had; and no
segment left behind by a SIGKILLed worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from elastic.tasks import readers
from elastic.tasks.readers import ItemReaders, Stacked

NOISY = Path(__file__).parent / "tasks" / "noisy"
SHM = Path("/dev/shm")
DEADLINE_S = 60.0


@pytest.fixture
def pair() -> Iterator[ItemReaders]:
    made = ItemReaders(2, NOISY, "task:Noisy", {}, None, stack=True)
    yield made
    made.close()


def _batch(read: Stacked | list[object]) -> object:
    assert isinstance(read, Stacked)
    return read.batch


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _segments(pid: int) -> set[str]:
    return {path.name for path in SHM.glob(f"{readers.SLOT_PREFIX}{pid}-*")}


def test_stacks_come_through_lent_segments_once_their_size_is_known(pair: ItemReaders) -> None:
    indices, seeds = list(range(20)), [500 + i for i in range(20)]
    first = pair.start(indices, seeds)
    assert not any(first._lent), "the first batch tells the size: through the pipe"
    through_pipe = _batch(first.result())
    second = pair.start(indices, seeds)
    lent = list(second._lent)
    assert len(lent) == 2 and all(lent), "a segment for each reader's share"
    through_memory = _batch(second.result())
    assert _same(through_memory, through_pipe)
    assert _same(through_memory, default_collate(pair.read(indices, seeds)))
    assert sorted(pair._slots._free, key=id) == sorted(lent, key=id), "back once copied out"
    again = _batch(pair.start(indices, [s + 1 for s in seeds]).result())
    assert not _same(again, through_memory)
    assert _same(through_memory, through_pipe), "copied out: the segments written again leave the batch alone"
    assert len(pair._slots._made) == 2, "the segments are lent again, not made again"
    if SHM.is_dir():
        assert _segments(os.getpid()) == {segment.name for segment in pair._slots._made}


def test_a_stack_larger_than_its_segment_comes_through_the_pipe_and_the_segments_grow(pair: ItemReaders) -> None:
    """A resize that leaves a worker more items a step (plain mode) makes each reader's stack
    larger than the segments lent so far."""
    small, large = list(range(10)), list(range(40))
    pair.start(small, small).result()
    pair.start(small, small).result()
    made = list(pair._slots._made)
    bigger = pair.start(large, large)
    assert all(bigger._lent), "the segments of the old size are lent"
    assert _same(_batch(bigger.result()), default_collate(pair.read(large, large)))
    grown = pair.start(large, large)
    assert all(segment is not None and segment not in made for segment in grown._lent), "made anew, larger"
    assert _same(_batch(grown.result()), default_collate(pair.read(large, large)))
    assert not set(map(id, made)) & set(map(id, pair._slots._made)), "the small ones removed"


def test_a_read_dropped_unread_gives_its_segments_back_once_its_readers_are_done(pair: ItemReaders) -> None:
    indices, seeds = list(range(40)), list(range(40))
    pair.start(indices, seeds).result()
    dropped = pair.start(indices, seeds)
    lent = [segment for segment in dropped._lent if segment is not None]
    assert len(lent) == 2
    futures = list(dropped._futures)
    del dropped  # what the read-ahead does after a resize
    deadline = time.monotonic() + DEADLINE_S
    while not all(future.done() for future in futures) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(future.done() for future in futures)
    assert sorted(pair._slots._free, key=id) == sorted(lent, key=id)
    busy = pair.start(indices, seeds)
    assert {id(segment) for segment in busy._lent} == {id(segment) for segment in lent}
    assert _same(_batch(busy.result()), default_collate(pair.read(indices, seeds)))


def test_with_no_shared_memory_to_be_had_the_stacks_come_through_the_pipe(
    pair: ItemReaders, capsys: pytest.CaptureFixture[str]
) -> None:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm here: the segment's pages are reserved through it")
    indices, seeds = list(range(10)), list(range(10))
    pair.start(indices, seeds).result()
    free = os.statvfs(SHM)
    pair._slots.needs(free.f_bavail * free.f_frsize + (1 << 30))  # more than is free: made, but not reserved
    read = pair.start(indices, seeds)
    assert not any(read._lent)
    assert pair._slots.unavailable is not None and "No space left on device" in pair._slots.unavailable
    said = capsys.readouterr().err
    assert said.count("data readers: no shared memory") == 1 and "come through a pipe" in said, said
    assert _same(_batch(read.result()), default_collate(pair.read(indices, seeds)))
    assert not pair._slots._made and not _segments(os.getpid()), "the segment that could not be had is gone"
    pair.start(indices, seeds).result()
    assert "data readers" not in capsys.readouterr().err, "said once"


def test_a_stack_of_every_kind_of_tensor_comes_out_of_its_segment_as_it_went_in() -> None:
    stack = {
        "image": torch.randn(4, 3, 5, 5),
        "crop": torch.randn(4, 3, 8, 8)[:, :, 1:6, ::2],  # not contiguous
        "label": torch.arange(4),
        "mask": torch.rand(4, 7) > 0.5,
        "half": torch.randn(4, 3, dtype=torch.bfloat16),
        "complex": torch.randn(4, 2, dtype=torch.complex64),
        "empty": torch.zeros(4, 0),
        "pair": [torch.arange(4, dtype=torch.int16), torch.zeros(4, 3, dtype=torch.uint8)],
    }
    placed, tensors, needed = readers._layout(stack)
    assert all(offset % readers._ALIGN == 0 for offset, _ in tensors)
    segment = readers.SharedMemory(create=True, size=needed)
    try:
        readers._write(segment.name, tensors)
        back = readers._from_slot(placed, segment)
        assert isinstance(back, dict) and back.keys() == stack.keys()
        assert all(_same(back[key], stack[key]) for key in stack)
        del back
    finally:
        readers._attached.pop(segment.name).close()
        segment.close()
        segment.unlink()


def test_a_reader_lets_go_of_the_segments_smaller_than_the_one_it_writes() -> None:
    """Segments only grow, and the worker removes the smaller ones once they are back: a reader
    that kept them mapped would keep their memory taken."""
    small, large = (readers.SharedMemory(create=True, size=size) for size in (4096, 8192))
    try:
        tensors = [(0, torch.ones(16))]
        readers._write(small.name, tensors)
        readers._write(small.name, tensors)
        assert small.name in readers._attached
        readers._write(large.name, tensors)
        assert small.name not in readers._attached and large.name in readers._attached
        assert torch.equal(torch.frombuffer(large.buf, dtype=torch.float32, count=16), torch.ones(16))
    finally:
        for segment in (small, large):
            if segment.name in readers._attached:
                readers._attached.pop(segment.name).close()
            segment.close()
            segment.unlink()


_KILLED = """
import sys, time
from pathlib import Path
from elastic.tasks.readers import ItemReaders
pair = ItemReaders(2, Path(sys.argv[1]), "task:Noisy", {}, None, stack=True)
for _ in range(int(sys.argv[2])):
    pair.start(list(range(20)), list(range(20))).result()
pending = pair.start(list(range(20)), list(range(20)))  # the readers are spawned by now
print(len(pair._slots._made), *(process.pid for process in pair._pool._processes.values()), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for init to reap it


@pytest.mark.skipif(not SHM.is_dir(), reason="segments are looked for in /dev/shm, readers in /proc")
@pytest.mark.parametrize("batches", [0, 3], ids=["while-its-readers-start", "after-its-batches"])
def test_a_sigkilled_workers_readers_die_and_its_segments_are_removed(batches: int) -> None:
    """Killed before its readers have started (they import torch for a second or more), or once
    they have stacked batches into its segments: no reader outlives it, no segment is left."""
    worker = subprocess.Popen([sys.executable, "-c", _KILLED, str(NOISY), str(batches)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])  # fmt: skip
    try:
        assert worker.stdout is not None
        made, *reader_pids = map(int, worker.stdout.readline().split())
        assert len(reader_pids) == 2 and made == len(_segments(worker.pid)) == (2 if batches else 0)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(DEADLINE_S)
    deadline = time.monotonic() + DEADLINE_S
    while (_segments(worker.pid) or any(map(_alive, reader_pids))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in reader_pids if _alive(pid)], "a reader outlived its worker"
    assert not _segments(worker.pid), "Python's resource tracker removes them once the worker and its readers are gone"
    _, stderr = worker.communicate(timeout=DEADLINE_S)  # to its end: the tracker, its last holder, is gone too
    assert "leaked" not in stderr, "the job's log (a worker's stderr) is no place for the tracker's cleanup"
