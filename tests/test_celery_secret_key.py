"""The Celery worker and beat refuse to start with DEBUG off on the public development
SECRET_KEY, as the portal does (portal.secrets_check), naming the variable; on a random key they
start. Each is a real `celery -A portal` process on the portal's own settings."""

from __future__ import annotations

import os
import secrets
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings

from tests.process_support import stop_process

ROOT = Path(__file__).resolve().parent.parent
REFUSAL = "SECRET_KEY is 'bungee-development-key-change-me-in-production'"
STARTED_WITHIN_S = 90
"""How long a process may take to refuse, or to show it started (a loaded 2-core machine
imports Django and Celery in 10-20 s)."""

# What each process logs once it is past the check (worker_init / beat_init): the worker's
# "celery@host ready.", the beat's first pass over its schedule (a debug line).
STARTED = {"worker": " ready.", "beat": "beat: Waking up"}


def command(process: str, tmp_path: Path, queue: str) -> list[str]:
    argv = [sys.executable, "-m", "celery", "-A", "portal", process, "--loglevel", "DEBUG"]
    if process == "worker":
        return [*argv, "-Q", queue, "--pool", "solo", "--without-mingle", "--without-gossip"]
    return [*argv, "-s", str(tmp_path / "celerybeat-schedule")]


def environment(tmp_path: Path, queue: str, secret_key: str | None) -> dict[str, str]:
    """The portal's settings (not the tests'), DEBUG off, on this machine's Redis under a queue
    of the test's own."""
    env = {key: value for key, value in os.environ.items() if key not in ("SECRET_KEY", "DEBUG", "DATABASE_URL")}
    env.update(
        DJANGO_SETTINGS_MODULE="portal.settings", BUNGEE_DATA_DIR=str(tmp_path / "data"),
        REDIS_URL=settings.REDIS_URL, BUNGEE_CELERY_QUEUE=queue,
    )
    if secret_key is not None:
        env["SECRET_KEY"] = secret_key
    return env


@pytest.fixture
def queue() -> Iterator[str]:
    name = f"secret-key-check-{os.getpid()}-{secrets.token_hex(4)}"
    yield name
    broker = redis.Redis.from_url(settings.REDIS_URL)
    for key in broker.scan_iter(f"*{name}*"):
        broker.delete(key)


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_the_development_key_stops_the_process_at_start(tmp_path: Path, queue: str, process: str) -> None:
    started = subprocess.run(
        command(process, tmp_path, queue), cwd=ROOT, env=environment(tmp_path, queue, None),
        capture_output=True, text=True, timeout=STARTED_WITHIN_S,
    )
    assert started.returncode != 0, started.stdout[-2000:] + started.stderr[-2000:]
    assert f"bungee: {REFUSAL}" in started.stderr, started.stderr[-2000:]
    assert "set the SECRET_KEY environment variable" in started.stderr


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_a_random_key_starts_the_process(tmp_path: Path, queue: str, process: str) -> None:
    running = subprocess.Popen(
        command(process, tmp_path, queue), cwd=ROOT, env=environment(tmp_path, queue, secrets.token_urlsafe(50)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    assert running.stdout is not None
    output = b""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(running.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + STARTED_WITHIN_S
            while STARTED[process].encode() not in output:
                left = deadline - time.monotonic()
                assert left > 0, f"no {STARTED[process]!r} within {STARTED_WITHIN_S} s:\n{output[-4000:].decode()}"
                if selector.select(timeout=left):
                    chunk = os.read(running.stdout.fileno(), 65536)
                    assert chunk, f"the {process} exited ({running.wait()}):\n{output[-4000:].decode()}"
                    output += chunk
        assert REFUSAL.encode() not in output
    finally:
        stop_process(running, timeout_s=30)
