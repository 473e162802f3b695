"""The launcher's process group (portal.launcher): the Celery processes come back when they exit
on their own, as a deployment's supervisor brings them back; a crash loop, or any other process
that exits, is reported dead."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from portal.launcher import RESTART_BURST, ProcessGroup

EXITS = [sys.executable, "-c", "import sys; print('ran', flush=True); sys.exit(3)"]
STAYS = [sys.executable, "-c", "import time; time.sleep(60)"]


def until_exited(group: ProcessGroup, name: str, timeout_s: float = 30) -> None:
    [managed] = [p for p in group.processes if p.name == name]
    managed.process.wait(timeout_s)


def test_a_restarted_process_comes_back_until_it_loops(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        group.start("worker", EXITS, restart=True)
        group.start("portal", STAYS)
        for restart in range(1, RESTART_BURST + 1):
            until_exited(group, "worker")
            assert group.dead() == [], f"restart {restart} is within the burst"
        until_exited(group, "worker")
        assert [p.name for p in group.dead()] == ["worker"], "one exit past the burst: a crash loop"
        log = (tmp_path / "worker.log").read_text()
        assert log.count("ran") == RESTART_BURST + 1
        assert f"worker exited with code 3; starting it again (1 of {RESTART_BURST} in 60 s)" in log
        assert [p.name for p in group.processes if p.process.poll() is None] == ["portal"]
    finally:
        group.stop(grace_s=5)


def test_a_process_without_restart_is_dead_at_once(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        group.start("agent-a", EXITS)
        until_exited(group, "agent-a")
        assert [p.name for p in group.dead()] == ["agent-a"]
        assert "starting it again" not in (tmp_path / "agent-a.log").read_text()
    finally:
        group.stop(grace_s=5)


def test_a_stopped_group_does_not_restart(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    beat = group.start("beat", STAYS, restart=True)
    group.stop(grace_s=30)
    assert beat.process.returncode == -signal.SIGTERM, "it ended on the SIGTERM, not on the SIGKILL after the grace"
    assert group.processes == [] and group.dead() == []
    assert "starting it again" not in (tmp_path / "beat.log").read_text()

