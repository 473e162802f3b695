"""The real `python -m agent` started with a pool token, against the real portal (a live server
on the test database): its registration gets the node's own token, which the agent keeps in its
state directory (mode 0600) and reports with; restarted with the same pool token file and state
directory, it registers again with the kept node token and keeps its node (the pool token alone
would be refused: the node is held). Neither secret is written to the agent's log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from portal.accounts.models import ApiToken
from portal.cluster.models import Node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    """The pools here are started by no Slurm pool of the portal's: an operator's bound lets them
    register (portal.cluster.binding)."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100", "k8s:100:100"]})

ROOT = Path(__file__).resolve().parent.parent


def wait_for(
    what: str, check: Callable[[], Any], agent: subprocess.Popen[bytes], log: Path, timeout_s: float = 60
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert agent.poll() is None, (
            f"the agent exited ({agent.returncode}) waiting for {what}:\n{log.read_text()}"
        )
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")


@pytest.fixture
def start_agent(
    live_server: Any, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Path]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(token_file: Path, name: str, devices: int) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"agent-{len(started)}.log"
        command = [
            sys.executable, "-m", "agent", "--portal", live_server.url, "--token-file", str(token_file),
            "--name", name, "--backend", "simulated", "--devices", str(devices), "--standbys", "0",
            "--report-interval", "0.3", "--worker-module", "tests.agent_fake_worker",
            "--state-dir", str(tmp_path / "state"),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb")
        )
        started.append(process)
        return process, log

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def stop(agent: subprocess.Popen[bytes], log: Path) -> None:
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, log.read_text()


def test_an_agent_with_a_pool_token_keeps_its_node_token_and_its_node(
    users: dict,
    tmp_path: Path,
    start_agent: Callable[..., tuple[subprocess.Popen[bytes], Path]],
    redis_client: Any,
) -> None:
    pool, pool_secret = ApiToken.issue(users["alice"], "pool slurm", ApiToken.Role.POOL, pool="slurm")
    token_file = tmp_path / "pool.token"
    token_file.touch(mode=0o600)
    token_file.write_text(pool_secret)
    name = f"slurm-{uuid.uuid4().hex[:8]}"
    kept = tmp_path / "state" / "node-token"

    agent, log = start_agent(token_file, name, 2)
    node = wait_for(
        "the node's registration",
        lambda: Node.objects.filter(name=name, agent_token__isnull=False).first(),
        agent,
        log,
    )
    node_token = node.agent_token
    assert node_token.issued_by == pool and node_token.role == ApiToken.Role.AGENT
    wait_for("the kept node token", kept.exists, agent, log)
    assert kept.stat().st_mode & 0o777 == 0o600
    node_secret = kept.read_text()
    assert ApiToken.lookup(node_secret) == node_token
    registered_seen = node.last_seen_at
    wait_for(
        "a report with the node token",
        lambda: ApiToken.objects.get(pk=node_token.pk).last_used_at,
        agent,
        log,
    )
    wait_for("reports", lambda: Node.objects.get(pk=node.pk).last_seen_at > registered_seen, agent, log)
    stop(agent, log)

    agent, log = start_agent(token_file, name, 3)
    wait_for(
        "the node registered again with 3 devices",
        lambda: Node.objects.get(pk=node.pk).devices.filter(present=True).count() == 3,
        agent,
        log,
    )
    seen = Node.objects.get(pk=node.pk).last_seen_at
    wait_for(
        "reports after the restart", lambda: Node.objects.get(pk=node.pk).last_seen_at > seen, agent, log
    )
    node.refresh_from_db()
    assert node.agent_token == node_token, "the same node token holds the same node"
    assert list(ApiToken.objects.filter(issued_by=pool)) == [node_token], "nothing new was issued"
    assert kept.read_text() == node_secret
    stop(agent, log)

    logs = "".join(path.read_text() for path in tmp_path.glob("agent-*.log"))
    assert pool_secret not in logs and node_secret not in logs
