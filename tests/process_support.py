"""Stopping a process a test started: asked first, killed past a deadline."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def stop_process(process: subprocess.Popen[Any], timeout_s: float) -> None:
    """Sends `process` SIGTERM and waits up to `timeout_s` for it to exit, reading what its pipes
    still hold (so that a full pipe cannot keep it from exiting); past that, SIGKILL and the same
    wait again. Raises subprocess.TimeoutExpired if it outlives even SIGKILL's wait."""
    process.send_signal(signal.SIGTERM)
    try:
        process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=timeout_s)
