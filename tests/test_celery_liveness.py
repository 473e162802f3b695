"""The real Celery worker and beat, on the real Redis, keep their liveness files
(portal.liveness) fresh: the worker at its heartbeats, beat at every turn of its scheduler loop
(a tick every 0.5 s here). A file left by an earlier run is not taken for this run's beat. These
are the files the Kubernetes exec probes read (deploy/kubernetes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic.liveness import age_problem
from tests.liveness_support import touched_again
from tests.process_support import stop_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def celery_process(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            stop_process(process, timeout_s=20)


def start(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT), **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def stale(path: Path) -> int:
    """Leaves `path` as an earlier run would have: present, an hour old."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    return path.stat().st_mtime_ns


def test_the_worker_beats_at_its_heartbeats(tmp_path: Path, celery_process: list[subprocess.Popen[bytes]]) -> None:
    alive = tmp_path / "worker.alive"
    left_over = stale(alive)
    queue = f"liveness-test-{os.getpid()}"
    worker = start(["worker", "-Q", queue, "-c", "1", "--without-mingle", "--without-gossip",
                    "-n", f"{queue}@%h", "--loglevel", "INFO"], tmp_path / "worker.log",
                   BUNGEE_LIVENESS_FILE=str(alive), BUNGEE_CELERY_QUEUE=queue)
    celery_process.append(worker)
    first = touched_again(alive, left_over, timeout_s=60)
    # Its heartbeats go on: touched again and again (every 2 s), not only at start.
    touched_again(alive, touched_again(alive, first, timeout_s=30), timeout_s=30)
    assert age_problem(alive, 30) is None
    assert worker.poll() is None, (tmp_path / "worker.log").read_text()


def test_beat_beats_at_every_tick(tmp_path: Path, celery_process: list[subprocess.Popen[bytes]]) -> None:
    from django.conf import settings

    alive = tmp_path / "beat.alive"
    left_over = stale(alive)
    queue = f"liveness-test-beat-{os.getpid()}"
    beat = start(["beat", "-S", "portal.liveness:LivenessScheduler", "-s", str(tmp_path / "celerybeat"),
                  "--loglevel", "INFO"], tmp_path / "beat.log",
                 BUNGEE_LIVENESS_FILE=str(alive), BUNGEE_SCHEDULE_TICK_S="0.5", BUNGEE_CELERY_QUEUE=queue)
    celery_process.append(beat)
    try:
        first = touched_again(alive, left_over, timeout_s=60)
        touched_again(alive, touched_again(alive, first, timeout_s=30), timeout_s=30)
        assert age_problem(alive, 30) is None
        assert beat.poll() is None, (tmp_path / "beat.log").read_text()
        # Beat touches the file at every tick, also at one where nothing was due (a wake-up for
        # another entry, or a little early): the tick task's sending comes by its deadline, not
        # necessarily before the third touch (a CI run at 23:39 saw three touches first).
        log = tmp_path / "beat.log"
        deadline = time.monotonic() + 30
        while "Sending due task scheduler tick" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "Sending due task scheduler tick" in log.read_text(), log.read_text()
    finally:
        redis.Redis.from_url(settings.REDIS_URL).delete(queue, f"_kombu.binding.{queue}")
