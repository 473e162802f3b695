"""The graceful stop: SIGTERM or SIGINT only sets a flag. The trainer carries the flag in the
per-step collective, so that every rank learns of a stop asked of any one of them at the same
step boundary, finishes that step, and exits after rank 0 has saved it.

Before that, while the worker still starts (imports torch, loads the job's code, builds the model
and makes its warm-up pass: seconds on a busy machine, minutes if the job's code is slow), it holds
no training state and nobody waits for it: a stop then raises StoppedStarting in the main thread,
which unwinds the start at once. The worker leaves that mode (`settle`) before it meets its peers,
where the rendezvous honours a stop at its next check (a worker with no state goes at once)."""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedStarting(BaseException):  # noqa: N818 - a way out, not an error
    """A stop arrived while the worker was still starting. A BaseException, so that the job's
    own code and the build's `except Exception` (which turn errors into the job's failure) let
    it through."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signal_number).name} while starting")
        self.signal_number = signal_number


class StopRequest:
    """Whether this process was asked to stop, and by which signal."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._starting = False

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def install(self, starting: bool = False) -> None:
        """Handle STOP_SIGNALS from now on by setting the flag and, while `starting` (until
        `settle`), by raising StoppedStarting too. Main thread only."""
        self._starting = starting
        for signal_number in STOP_SIGNALS:
            signal.signal(signal_number, self._handle)

    def settle(self) -> None:
        """The start is over: from now on a stop only sets the flag."""
        self._starting = False

    def _handle(self, signal_number: int, frame: FrameType | None) -> None:
        self.signal_number = signal_number
        if self._starting:
            self._starting = False  # once: a second signal during the unwinding only sets the flag
            raise StoppedStarting(signal_number)
