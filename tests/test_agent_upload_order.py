"""A job's artifacts reach the portal only after the events that say the job ran on this node:
the portal refuses artifacts from a node it does not know the job ran on (403). A worker that a
warm standby started can train a one-step job and export its model before the agent's next
report; the upload must wait for that report. The agent here is the real one (agent.main.Agent,
its uploader thread included) against a portal client that records what arrives in what order."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from agent.devices.simulated import SimulatedBackend
from agent.main import Agent
from agent.settings import AgentConfig
from agent.supervisor import SupervisorConfig
from elastic.artifacts import ARTIFACT_NAMES
from elastic.wire import AgentReport, WorkerEvent

UPLOAD_GRACE_S = 1.0
"""How long the recording portal holds a report open, watching for an upload that overtakes it."""


class RecordingPortal:
    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self.uploaded = threading.Event()

    def report(self, report: AgentReport) -> list[dict[str, Any]]:
        # A report in flight: an upload sent before it was answered would overtake it.
        self.uploaded.wait(UPLOAD_GRACE_S)
        self.arrivals.append("report: " + ", ".join(event.kind for event in report.events))
        return []

    def upload_artifacts(self, job_id: int, files: dict[str, Path]) -> None:
        self.arrivals.append(f"artifacts of job {job_id}")
        self.uploaded.set()

    def close(self) -> None:
        pass


class OneWorker:
    """The supervisor of a worker that started, trained its only step and exported its model
    between two reports."""

    def __init__(self, state_dir: Path, run_dir: Path) -> None:
        self.state_dir = state_dir
        self.config = SupervisorConfig(state_dir=state_dir)  # the agent reads its interpreter
        now = time.time()
        key = {"job_id": 3, "generation": 1, "rank": 0}
        self._events = [
            WorkerEvent(**key, kind="started", at=now, pid=1234, device_index=0),
            WorkerEvent(**key, kind="joined", at=now, pid=1234),
            WorkerEvent(**key, kind="artifacts", at=now, step=1, message=str(run_dir)),
        ]
        self.delivered = 0

    def running(self) -> list[Any]:
        return []

    def drain_events(self) -> list[WorkerEvent]:
        events, self._events = self._events, []
        return events

    def events_delivered(self) -> None:
        self.delivered += 1

    def confined(self, job_id: int, run_dir: str, argv: list[str], env: Any) -> tuple[list[str], dict[str, str]]:
        return argv, dict(env)  # jobs run as the agent's user here

    def standby_pids(self) -> dict[int, int]:
        return {}

    def standby_interpreters(self) -> set[str]:
        return set()

    def keep_standbys(self, backend: Any, taken: set[int]) -> None:
        pass

    def stop(self, command: Any) -> int:
        raise AssertionError("no command is sent in this test")


def test_the_artifacts_wait_for_the_report_that_says_where_the_job_ran(tmp_path: Path) -> None:
    run_dir = tmp_path / "job-3-20261128T000000" / "artifacts"  # the artifacts directory, as a worker names it
    run_dir.mkdir(parents=True)
    for name in ARTIFACT_NAMES:
        (run_dir / name).write_bytes(b"x")
    portal = RecordingPortal()
    stopping = threading.Event()
    config = AgentConfig(
        portal_url="http://portal.invalid", token="t", node_name="node-a", address="127.0.0.1",
        backend="simulated", sim_devices=1, redis_url=None, report_interval_s=0.1, stop_grace_s=1.0,
        worker_module="elastic.worker", log_level="INFO", state_dir=tmp_path / "state",
    )
    agent = Agent(config, SimulatedBackend(slots=1), portal, OneWorker(tmp_path / "state", run_dir), stopping)  # type: ignore[arg-type]
    try:
        agent._report()
        assert portal.uploaded.wait(10), "the artifacts were never uploaded"
        assert portal.arrivals == ["report: started, joined", "artifacts of job 3"]
    finally:
        stopping.set()
