"""Reads the output of every worker of the node in one thread, and sees each worker's process end.

A worker writes to a file in the agent's state directory, never to a pipe (it must outlive its
agent: see agent.supervisor), and a regular file is always "readable" to select(), so the reader
cannot wait on the files themselves. It waits instead on the workers' pidfds (readable once a
process has exited, whoever its parent is), and reads every file that grew at least every
TAIL_EVERY_S: a line shows up that late at most, an exit at once. Whether a worker ended is
WorkerProcess.has_ended's word, asked at each pass of a worker without a pidfd (a re-adopted one
whose process was already gone is seen to have ended at the first pass) and of one whose pidfd
said its process exited; never of one whose pidfd is quiet (its process runs). A forked worker's
end is the fork server's word, which comes after its pidfd's (and has no descriptor to wait on):
from its pidfd's word to the server's, it is asked at each pass.

Per worker, whole lines go to `on_line` with the offset where they end, in file order; once the
process has ended, its leftover process group is killed (WorkerProcess.ended), the rest of the
file as it stands then is read (a last line without its newline included), and `on_end` is
called: every event of a worker comes before its end. A worker that floods its output is read in
turns with the others (LINES_PER_PASS), so that it holds none of them back.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.worker_process import WorkerProcess

log = logging.getLogger(__name__)

TAIL_EVERY_S = 0.05
"""How long the reader waits between two passes over the files while nothing ended."""
MAX_LINE_BYTES = 64 * 1024
"""A longer line is taken in pieces of this many bytes."""
LINES_PER_PASS = 1000
"""The most lines taken from one worker in one pass."""


@dataclass
class _Tail:
    worker: WorkerProcess
    output: BinaryIO | None
    """None if the file could not be opened: only the worker's end is watched."""
    waiting_on_pidfd: bool = False
    """Its worker's pidfd is in the selector: its process had not exited at the last select."""


class OutputReader:
    """The node's worker outputs. `watch` a worker once it runs (or was re-adopted); `close`
    when the supervisor is done. `on_line(worker, line, offset)` and `on_end(worker)` are called
    from the reader's thread."""

    def __init__(
        self,
        output_path: Callable[[str], Path],
        on_line: Callable[[WorkerProcess, bytes, int], None],
        on_end: Callable[[WorkerProcess], None],
    ) -> None:
        self._output_path = output_path
        self._on_line = on_line
        self._on_end = on_end
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._new: list[_Tail] = []
        self._closed = False
        self._tails: list[_Tail] = []
        """The reader thread's own: the workers it reads."""
        self._thread = threading.Thread(target=self._run, name="worker-output", daemon=True)
        self._thread.start()

    def watch(self, worker: WorkerProcess) -> None:
        """Reads `worker`'s output from its `read_offset` on, until its process has ended."""
        output: BinaryIO | None
        try:
            output = self._output_path(worker.stem).open("rb")
            output.seek(worker.read_offset)
        except OSError as err:
            log.error("cannot read the output of pid %s: %s", worker.pid, err)
            output = None
        with self._lock:
            if not self._closed:
                self._new.append(_Tail(worker, output))
                self._wake()
                return
        log.warning("not reading the output of pid %s: the reader is closed", worker.pid)
        if output is not None:
            output.close()

    def close(self, timeout_s: float) -> None:
        """Stops reading (what has not ended by now is not reported) and waits up to `timeout_s`
        for the thread to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("the worker output reader did not stop within %.0f s", timeout_s)

    def _wake(self) -> None:
        """Wakes the thread from its wait (call under the lock, while not closed: the thread
        closes the pipe once it has seen `_closed`)."""
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:  # the pipe is full: the thread is woken already
            pass

    def _run(self) -> None:
        try:
            while self._pass():
                pass
        finally:
            for tail in self._tails:
                if tail.output is not None:
                    tail.output.close()
            self._selector.close()
            with self._lock:
                self._closed = True  # also when the loop failed: nobody writes to the pipe now
                os.close(self._wake_read)
                os.close(self._wake_write)

    def _pass(self) -> bool:
        """Reads every worker's output once and settles those that ended; then waits for an
        end, a new worker or TAIL_EVERY_S. Returns False once closed."""
        with self._lock:
            if self._closed:
                return False
            new, self._new = self._new, []
        for tail in new:
            if tail.worker.pidfd is not None:
                self._selector.register(tail.worker.pidfd, selectors.EVENT_READ, tail)
                tail.waiting_on_pidfd = True
            self._tails.append(tail)
        more = False
        for tail in list(self._tails):
            try:
                # A quiet pidfd: the process runs (the select below hears its exit). Asked before
                # reading: a read after it gets everything.
                if not tail.waiting_on_pidfd and tail.worker.has_ended():
                    self._end(tail)
                else:
                    more |= self._read(tail, complete=False)
            except Exception:
                log.exception(
                    "reading the output of pid %s failed; it is not read any further", tail.worker.pid
                )
                if tail.output is not None:
                    tail.output.close()
                    tail.output = None
        for key, _ in self._selector.select(0 if more else TAIL_EVERY_S):
            if key.fileobj == self._wake_read:
                while True:
                    try:
                        if not os.read(self._wake_read, 4096):
                            break
                    except BlockingIOError:
                        break
            else:
                # It stays readable from now on: its end is read at the next pass.
                self._stop_waiting(key.data)
        return True

    def _stop_waiting(self, tail: _Tail) -> None:
        if tail.waiting_on_pidfd:
            self._selector.unregister(tail.worker.pidfd)  # type: ignore[arg-type]
            tail.waiting_on_pidfd = False

    def _end(self, tail: _Tail) -> None:
        self._tails.remove(tail)
        self._stop_waiting(tail)
        tail.worker.ended()
        try:
            if tail.output is not None:
                self._read(tail, complete=True)
        finally:
            if tail.output is not None:
                tail.output.close()
            self._on_end(tail.worker)

    def _read(self, tail: _Tail, complete: bool) -> bool:
        """Takes the whole lines written so far (`complete`: the process has ended; every byte
        there now, a last line without its newline too). Returns whether more may be waiting
        (LINES_PER_PASS were taken)."""
        output = tail.output
        if output is None:
            return False
        end = os.fstat(output.fileno()).st_size if complete else None
        taken = 0
        while complete or taken < LINES_PER_PASS:
            if end is not None and output.tell() >= end:
                return False
            raw = output.readline(MAX_LINE_BYTES)
            if raw.endswith(b"\n") or len(raw) == MAX_LINE_BYTES or (raw and complete):
                self._on_line(tail.worker, raw, output.tell())
                taken += 1
                continue
            if raw:  # the worker is still writing this line
                output.seek(-len(raw), os.SEEK_CUR)
            return False
        return True
