"""Waiting for a liveness file (elastic.liveness) to be touched, for the tests of the processes
that touch one."""

from __future__ import annotations

import time
from pathlib import Path


def touched_again(path: Path, after_ns: int, timeout_s: float = 20.0) -> int:
    """Waits until `path` exists with a modification time after `after_ns`; returns that time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        if mtime > after_ns:
            return mtime
        time.sleep(0.05)
    raise AssertionError(f"{path} was not touched after {after_ns} within {timeout_s} s")
