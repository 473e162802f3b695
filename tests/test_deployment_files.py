"""The deployment description: docker-compose accepts it, and it has every service a real
deployment needs, with the agent reserving NVIDIA GPUs."""

from __future__ import annotations

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
    done = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
