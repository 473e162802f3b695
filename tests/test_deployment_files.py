"""The deployment description: docker-compose accepts it, and it has every service a real
deployment needs, with the agent reserving NVIDIA GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_has_every_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"postgres", "redis", "portal", "worker", "beat", "agent"}
    devices = compose["services"]["agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert (ROOT / compose["services"]["portal"]["build"]["dockerfile"]).is_file()


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_accepts_it() -> None:
    secrets = {"SECRET_KEY": "k" * 50, "POSTGRES_PASSWORD": "p", "BUNGEE_AGENT_TOKEN": "t"}
    done = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **secrets})
    assert done.returncode == 0, done.stderr


def test_no_secret_has_a_usable_default() -> None:
    """The portal's secrets are required (${VAR:?...}): compose refuses to start without them.
    The agent token defaults to empty, which the agent refuses (tests/test_agent_cli.py)."""
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in ("SECRET_KEY", "POSTGRES_PASSWORD"):
        uses = [line for line in text.splitlines() if "${" + variable in line]
        assert uses, variable
        assert all("${" + variable + ":?" in line for line in uses), uses
    assert [line.split(":", 1)[1].strip() for line in text.splitlines() if "${BUNGEE_AGENT_TOKEN" in line] == [
        "${BUNGEE_AGENT_TOKEN:-}"
    ]
    assert "change-me" not in text


def test_the_portal_runs_several_processes_on_one_port() -> None:
    """uvicorn's workers (portal.launcher.portal_command), BUNGEE_PORTAL_PROCESSES of them,
    two unless .env says otherwise; tests/test_live_two_portals.py runs two for real."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["portal"]["command"][-1]
    assert "-m uvicorn portal.asgi:application" in command
    assert "--workers ${BUNGEE_PORTAL_PROCESSES:-2}" in command
    assert compose["services"]["portal"]["ports"] == ["${PORT:-8000}:8000"]
