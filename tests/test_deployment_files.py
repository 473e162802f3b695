"""The deployment description: docker-compose accepts it, and it has every service a real
deployment needs, with the agent reserving NVIDIA GPUs."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from portal.launcher import portal_command

ROOT = Path(__file__).resolve().parent.parent


def test_compose_has_every_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"postgres", "redis", "portal", "worker", "beat", "agent"}
    devices = compose["services"]["agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert (ROOT / compose["services"]["portal"]["build"]["dockerfile"]).is_file()


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_accepts_it() -> None:
    secrets = {"SECRET_KEY": "k" * 50, "POSTGRES_PASSWORD": "p", "REDIS_PASSWORD": "r", "BUNGEE_AGENT_TOKEN": "t"}
    done = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **secrets})
    assert done.returncode == 0, done.stderr


def test_no_secret_has_a_usable_default() -> None:
    """The portal's secrets are required (${VAR:?...}): compose refuses to start without them.
    The agent token defaults to empty, which the agent refuses (tests/test_agent_cli.py)."""
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in ("SECRET_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD"):
        uses = [line for line in text.splitlines() if "${" + variable in line]
        assert uses, variable
        assert all("${" + variable + ":?" in line for line in uses), uses
    assert [line.split(":", 1)[1].strip() for line in text.splitlines() if "${BUNGEE_AGENT_TOKEN" in line] == [
        "${BUNGEE_AGENT_TOKEN:-}"
    ]
    assert "change-me" not in text


def test_the_portal_runs_the_one_server_on_several_processes() -> None:
    """The portal's command is portal.launcher.portal_command, the one `make demo` and the tests'
    platforms run (uvicorn through portal.serve), with BUNGEE_PORTAL_PROCESSES processes, two
    unless .env says otherwise (tests/test_live_two_portals.py runs two for real); forwarded
    headers are believed from BUNGEE_FORWARDED_ALLOW_IPS only, empty unless .env sets it."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    portal = compose["services"]["portal"]
    prepare, _, server = portal["command"][-1].rpartition("&& exec ")
    assert "manage.py migrate --noinput" in prepare
    expected = ["python", *portal_command(8000, "0.0.0.0", 2)]
    expected[expected.index("--processes") + 1] = "${BUNGEE_PORTAL_PROCESSES:-2}"
    assert shlex.split(server) == expected
    assert portal["ports"] == ["${PORT:-8000}:8000"]
    assert portal["environment"]["BUNGEE_FORWARDED_ALLOW_IPS"] == "${BUNGEE_FORWARDED_ALLOW_IPS:-}"
    assert portal["environment"]["DATABASE_URL"] == compose["services"]["worker"]["environment"]["DATABASE_URL"]


def test_the_agent_has_time_to_drain_before_docker_kills_it() -> None:
    """`docker compose stop` sends SIGTERM, then SIGKILL after the stop grace period: the agent's
    drain (its default deadline) and its workers' save (the stop grace) must fit in it."""
    from agent.settings import AgentSettings

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grace = compose["services"]["agent"]["stop_grace_period"]
    assert grace.endswith("s")
    defaults = AgentSettings.from_environ({})
    assert defaults.on_term == "drain"
    assert float(grace[:-1]) > defaults.drain_deadline + defaults.stop_grace
