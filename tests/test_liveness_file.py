"""elastic.liveness: the file a process without HTTP touches as its loop turns, and the exec
probe that reads its age (`python -m elastic.liveness FILE --max-age S`, run as a process, as
kubelet runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.settings import AgentSettings
from elastic.liveness import LivenessFile
from portal.config import PortalSettings

ROOT = Path(__file__).resolve().parent.parent


def probe(path: Path, max_age: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic.liveness", str(path), "--max-age", max_age],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_the_probe_passes_on_a_fresh_file_and_fails_on_an_old_or_missing_one(tmp_path: Path) -> None:
    alive = tmp_path / "state" / "alive"
    missing = probe(alive, "30")
    assert missing.returncode == 1
    assert "does not exist" in missing.stderr

    LivenessFile(alive).beat()
    fresh = probe(alive, "30")
    assert (fresh.returncode, fresh.stderr) == (0, "")

    an_hour_ago = time.time() - 3600
    os.utime(alive, (an_hour_ago, an_hour_ago))
    old = probe(alive, "30")
    assert old.returncode == 1
    assert "last touched 3600 s ago, more than --max-age 30 s" in old.stderr

    LivenessFile(alive).beat()
    assert probe(alive, "30").returncode == 0


def test_the_probe_refuses_a_max_age_that_is_not_above_zero(tmp_path: Path) -> None:
    done = probe(tmp_path / "alive", "0")
    assert done.returncode == 2
    assert "--max-age 0 must be above 0" in done.stderr


def test_start_forgets_the_file_an_earlier_run_left(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    LivenessFile(alive).beat()
    LivenessFile(alive).start()
    assert not alive.exists()


@pytest.mark.parametrize("settings", [PortalSettings, AgentSettings])
def test_without_the_variable_nothing_is_written(tmp_path: Path, settings: type[PortalSettings | AgentSettings]) -> None:
    """BUNGEE_LIVENESS_FILE, read by the portal's settings (its Celery worker and beat) and the agent's."""
    unset = LivenessFile(settings.from_environ({}).liveness_file)
    unset.beat()
    unset.start()
    assert unset.path is None
    named = LivenessFile(settings.from_environ({"BUNGEE_LIVENESS_FILE": str(tmp_path / "alive")}).liveness_file)
    named.beat()
    assert named.path == tmp_path / "alive" and named.path.is_file()


def test_a_file_that_cannot_be_written_does_not_stop_the_process(tmp_path: Path) -> None:
    """Its folder is a file: every beat fails (OSError), none raises."""
    (tmp_path / "not-a-folder").write_text("")
    stuck = LivenessFile(tmp_path / "not-a-folder" / "alive")
    stuck.beat()
    stuck.beat()
    assert probe(tmp_path / "not-a-folder" / "alive", "30").returncode == 1
