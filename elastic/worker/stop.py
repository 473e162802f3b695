"""The graceful stop: SIGTERM or SIGINT only sets a flag. The trainer carries the flag in the
per-step collective, so that every rank learns of a stop asked of any one of them at the same
step boundary, finishes that step, and exits after rank 0 has saved it."""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Whether this process was asked to stop, and by which signal."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def install(self) -> None:
        """Handle STOP_SIGNALS from now on by setting the flag. Main thread only."""
        for signal_number in STOP_SIGNALS:
            signal.signal(signal_number, self._handle)

    def _handle(self, signal_number: int, frame: FrameType | None) -> None:
        self.signal_number = signal_number
