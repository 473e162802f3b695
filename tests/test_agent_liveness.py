"""The real `python -m agent` process keeps its liveness file (BUNGEE_LIVENESS_FILE) fresh both
while the portal refuses it (the registration loop) and while it reports: the exec probe of its
Kubernetes DaemonSet must not restart an agent whose portal is away, since its workers train on
meanwhile. The portal stand-in and the agent process are those of tests/test_agent_process.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic.liveness import age_problem
from elastic.wire import command_stream
from tests.test_agent_process import REDIS_URL, AgentProcess, FakePortal

pytestmark = pytest.mark.slow


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


@pytest.fixture
def node() -> Iterator[str]:
    name = f"agent-liveness-{uuid.uuid4().hex[:8]}"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(command_stream(name))


def test_the_agent_beats_while_registering_and_while_reporting(
    node: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive = tmp_path / "health" / "alive"
    monkeypatch.setenv("BUNGEE_LIVENESS_FILE", str(alive))
    portal = FakePortal(node)
    portal.available = False
    agent = AgentProcess(portal.url, node, tmp_path / "agent.log", "agent-test-token",
                         "--state-dir", str(tmp_path / "state"))
    try:
        first = touched_again(alive, 0)
        portal.wait_for(lambda: portal.attempts >= 2, "a second registration attempt")
        touched_again(alive, first)
        assert not portal.registrations
        assert age_problem(alive, 30) is None

        with portal._lock:
            portal.available = True
        portal.wait_for(lambda: len(portal.reports) >= 2, "two reports")
        reporting = touched_again(alive, alive.stat().st_mtime_ns)
        touched_again(alive, reporting)
        assert agent.stop() == 0, agent.stderr()
    finally:
        agent.kill()
        portal.close()
