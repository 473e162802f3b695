"""The real `python -m agent` process keeps its liveness file (BUNGEE_LIVENESS_FILE) fresh both
while the portal refuses it (the registration loop) and while it reports: the exec probe of its
Kubernetes DaemonSet must not restart an agent whose portal is away, since its workers train on
meanwhile. The portal stand-in and the agent process are those of tests/test_agent_process.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic.liveness import age_problem
from elastic.wire import command_stream
from tests.liveness_support import touched_again
from tests.test_agent_process import REDIS_URL, AgentProcess, FakePortal

pytestmark = pytest.mark.slow


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

        portal.available = True
        portal.wait_for(lambda: len(portal.reports) >= 2, "two reports")
        reporting = touched_again(alive, alive.stat().st_mtime_ns)
        touched_again(alive, reporting)
        assert agent.stop() == 0, agent.stderr()
    finally:
        agent.kill()
        portal.close()
