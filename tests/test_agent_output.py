"""The output reader (agent.output) with a real process: every line a worker wrote, its last one
without a newline included, reaches `on_line` before its end is reported, whether its end is heard
through its pidfd or asked at each pass; and a worker whose pidfd is quiet is never asked whether
it ended."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.output import OutputReader
from agent.worker_process import WorkerProcess

DEADLINE_S = 30.0

WRITER = """
import sys
print("first", flush=True)
sys.stdin.readline()
sys.stdout.write("second\\nlast, no newline")
"""
"""Writes a line, waits to be told (stdin), writes another and an unfinished one, and exits."""


@pytest.mark.parametrize("with_pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_every_line_comes_before_the_end_and_a_quiet_pidfd_is_not_asked(
    tmp_path: Path, with_pidfd: bool
) -> None:
    output = tmp_path / "worker.out"
    with output.open("ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER],
            stdin=subprocess.PIPE,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the reader kills the worker's group once it ended
        )
    worker = WorkerProcess(job_id=1, generation=1, rank=0, device_index=0, stem="worker")
    worker.spawned(process, None, os.pidfd_open(process.pid) if with_pidfd else None)
    asked_while_running = 0
    has_ended = worker.has_ended

    def counted_has_ended() -> bool:
        nonlocal asked_while_running
        ended = has_ended()
        asked_while_running += not ended
        return ended

    worker.has_ended = counted_has_ended  # type: ignore[method-assign]
    heard: list[bytes] = []
    first_line, end = threading.Event(), threading.Event()
    at_end: list[list[bytes]] = []

    def on_line(_: WorkerProcess, line: bytes, offset: int) -> None:
        heard.append(line)
        first_line.set()

    def on_end(_: WorkerProcess) -> None:
        at_end.append(list(heard))
        end.set()

    reader = OutputReader(lambda stem: tmp_path / f"{stem}.out", on_line, on_end)
    try:
        reader.watch(worker)
        assert first_line.wait(DEADLINE_S), "the first line was not read"
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        process.stdin.close()
        assert end.wait(DEADLINE_S), "the worker's end was not seen"
        assert at_end == [[b"first\n", b"second\n", b"last, no newline"]]
        if with_pidfd:
            assert asked_while_running == 0
        else:
            assert asked_while_running > 0  # its end could only be asked for
    finally:
        reader.close(DEADLINE_S)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=DEADLINE_S)
