"""The fork server (elastic.worker.forkserver): what a forked child is given, how its end is
told, what is refused, and that the server's end leaves its children running."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.worker.forkserver import ForkedProcess, ForkServer, ForkServerError

MODULE = "tests.forkserver_child"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    started = ForkServer(dict(os.environ))
    try:
        assert started.wait_ready(), "the fork server did not import the runtime in time"
        yield started
    finally:
        started.close()


class Child:
    """A forked child with pipes for its stdin and its stdout."""

    def __init__(self, server: ForkServer, env: dict[str, str] | None = None, **options: Any) -> None:
        stdin_read, self.stdin = os.pipe()
        self.stdout, stdout_write = os.pipe()
        try:
            self.process: ForkedProcess = server.spawn(
                MODULE, {**os.environ, **(env or {})}, stdin_read, stdout_write, stdout_write, **options
            )
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
        self.stream = open(self.stdout, encoding="utf-8")  # noqa: SIM115 - closed by finish

    def said(self) -> dict[str, Any]:
        return json.loads(self.stream.readline())

    def finish(self, line: str) -> tuple[int, str]:
        os.write(self.stdin, line.encode() + b"\n")
        os.close(self.stdin)
        code = self.process.wait(timeout=30)
        rest = self.stream.read()
        self.stream.close()
        return code, rest


def test_a_child_gets_its_arguments_environment_session_and_cores(server: ForkServer) -> None:
    child = Child(server, {"FOO": "bar"}, args=["--flag", "x"], new_session=True, cpu_affinity=[0])
    said = child.said()
    assert said["argv"] == ["--flag", "x"] and said["name"] == "__main__"
    assert said["env"]["FOO"] == "bar", "its environment replaces the server's"
    assert said["env"]["KMP_DUPLICATE_LIB_OK"] == "True", "what torch's import set, as in a fresh process"
    assert said["own_session"] and said["cores"] == [0]
    assert said["torch_loaded"], "forked with the runtime imported"
    assert said["cmdline"] == f"{sys.executable} -m {MODULE} --flag x", "ps shows what it runs, not the server"
    assert child.finish("7") == (7, "")


def test_an_end_is_told_with_its_code_and_the_pid_stays_until_it_is_waited_for(server: ForkServer) -> None:
    child = Child(server)
    pid = child.said()["pid"]
    assert child.process.poll() is None
    child.process.kill()
    assert child.process.wait_ended(timeout=30)
    os.kill(pid, 0)  # ended but not reaped: the pid is still its (a zombie), no other process's
    assert child.process.wait(timeout=5) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"pid {pid} was not reaped once waited for")
    os.close(child.stdin)
    child.stream.close()


def test_an_error_in_the_child_ends_it_with_1_and_its_traceback(server: ForkServer) -> None:
    child = Child(server)
    child.said()
    code, rest = child.finish("raise")
    assert code == 1 and "RuntimeError: the child's own error" in rest


def test_children_draw_different_random_numbers(server: ForkServer) -> None:
    children = [Child(server) for _ in range(3)]
    numbers = {child.said()["random"] for child in children}
    for child in children:
        assert child.finish("0")[0] == 0
    assert len(numbers) == 3, "numpy's generator reseeded in each child, as in a fresh process"


@pytest.mark.parametrize(
    "name, value",
    [
        ("PYTHONPATH", "/elsewhere"),
        # torch reads it at its first allocation, in the server: a child could not change it
        ("THP_MEM_ALLOC_ENABLE", "0" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "1"),
    ],
)
def test_a_start_up_variable_that_differs_is_refused(server: ForkServer, name: str, value: str) -> None:
    with pytest.raises(ForkServerError, match=name):
        Child(server, {name: value})
    child = Child(server)  # the server goes on
    child.said()
    assert child.finish("0")[0] == 0


def test_the_servers_end_leaves_its_children_running() -> None:
    own = ForkServer(dict(os.environ))
    assert own.wait_ready()
    child = Child(own)
    pid = child.said()["pid"]
    own.close()
    assert own.process.returncode == 0
    os.kill(pid, 0)  # still running, reparented
    os.write(child.stdin, b"0\n")
    os.close(child.stdin)
    assert child.stream.read() == ""  # it ended: its stdout closed
    child.stream.close()
    assert child.process.wait(timeout=5) is None, "seen to end, its code unknown once its server is gone"
    assert child.process.ended


def test_a_server_that_cannot_start_is_not_waited_for() -> None:
    broken = ForkServer({**os.environ, "PYTHONPATH": "/nonexistent"}, python="/bin/false")
    assert not broken.wait_ready(timeout_s=60)
    # The wait ended because its end was seen (the reader sets the event when the server is
    # gone), not because the deadline passed with the event still clear.
    assert broken._ready.is_set(), "its end is seen at once, not at the deadline"
    with pytest.raises(ForkServerError, match="not ready"):
        broken.spawn(MODULE, dict(os.environ), 0, 1, 2)
    broken.close()
