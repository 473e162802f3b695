"""Who may stop a worker with SIGTERM (elastic.worker.stop), without Slurm: a stand-in worker (the
runtime's own hold_term, StopRequest and TermGate, still starting, no torch) and a stand-in agent
(a process that sends the TERM it is told to). A TERM from anyone else (here: the test process,
as Slurm's slurmstepd is to a real worker) is written once and dropped; the agent's stops the
start at once, or ends a waiting standby (whose SIGTERM keeps its default action); a TERM from
the worker itself (its heartbeat told to leave) stops it too, and so
does anyone's once the agent is gone (a restarted agent that re-adopted it has another pid)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO

import pytest

from elastic.worker.stop import AGENT_PID_ENV, TermGate
from tests.platform import ROOT

WORKER = """
import time
from elastic.worker.stop import StoppedStarting, StopRequest, agent_pid, guard_term, hold_term
hold_term()
stop = StopRequest()
stop.install(starting=True)
guard_term(agent_pid())
print("ready", flush=True)
try:
    time.sleep(30)  # one blocking call: the agent's stop cuts it short
    print("never stopped", flush=True)
except StoppedStarting as stopped:
    print(stopped, flush=True)
"""
STANDBY = """
import time
from elastic.worker.stop import agent_pid, guard_term
guard_term(agent_pid())  # SIGTERM keeps its default action: a standby waiting holds nothing
print("ready", flush=True)
time.sleep(30)
"""
AGENT = """
import os, signal, sys
for line in sys.stdin:
    os.kill(int(line), signal.SIGTERM)
"""
WAIT_S = 20.0


def line_of(stream: IO[str], timeout_s: float = WAIT_S) -> str:
    """The next line of a child's pipe; fails the test if none comes in time."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"no line within {timeout_s:g} s"
    return stream.readline().strip()


def term_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for process `pid` to take it (its shared pending set)."""
    with open(f"/proc/{pid}/status") as status:
        pending = next(line for line in status if line.startswith("ShdPnd:")).split()[1]
    return bool(int(pending, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.fixture
def agent() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, text=True)
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def start_worker(agent: subprocess.Popen[str], code: str = WORKER) -> subprocess.Popen[str]:
    env = {**os.environ, AGENT_PID_ENV: str(agent.pid), "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert line_of(worker.stdout) == "ready"  # type: ignore[arg-type]
    return worker


def strangers_terms_dropped(worker: subprocess.Popen[str], agent: subprocess.Popen[str]) -> None:
    """Two TERMs from the test process: the first is written, both are dropped."""
    os.kill(worker.pid, signal.SIGTERM)
    said = line_of(worker.stderr)  # type: ignore[arg-type]
    assert said == f"TERM from pid {os.getpid()} (not this node's agent, pid {agent.pid}): the agent decides"
    os.kill(worker.pid, signal.SIGTERM)
    # Taken before the agent's is sent: two TERMs pending at once are one to the kernel.
    deadline = time.monotonic() + WAIT_S
    while term_pending(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.poll() is None, "a stranger's TERM does not stop the worker"
    assert agent.stdin is not None
    agent.stdin.write(f"{worker.pid}\n")
    agent.stdin.flush()


def test_a_strangers_term_is_dropped_and_the_agents_stops_the_start(agent: subprocess.Popen[str]) -> None:
    worker = start_worker(agent)
    try:
        strangers_terms_dropped(worker, agent)
        assert line_of(worker.stdout) == "stopped by SIGTERM while starting"  # type: ignore[arg-type]
        assert worker.wait(WAIT_S) == 0
        assert worker.stderr is not None and worker.stderr.read() == "", "said once"
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def test_a_waiting_standby_ends_on_its_agents_term_only(agent: subprocess.Popen[str]) -> None:
    standby = start_worker(agent, STANDBY)
    try:
        strangers_terms_dropped(standby, agent)
        assert standby.wait(WAIT_S) == -signal.SIGTERM, "the default action, as if it had not been held"
    finally:
        if standby.poll() is None:
            standby.kill()
        standby.wait()


def test_the_worker_itself_and_anyone_once_the_agent_is_gone_may_stop_it(agent: subprocess.Popen[str]) -> None:
    gate = TermGate(agent.pid, obey=lambda: None, say=lambda line: None)
    assert gate.obeys(agent.pid) and gate.obeys(os.getpid()), "its agent, and itself"
    assert not gate.obeys(1) and not gate.obeys(0), "anyone else, while the agent lives"
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + WAIT_S
    while gate.agent_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gate.obeys(1), "the agent is gone: whoever re-adopted the worker may stop it"
