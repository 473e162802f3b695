"""An agent that dies leaves its workers training, and the next agent of the node takes them back.

A supervisor in a process of its own (tests/agent_supervisor_host.py) starts a fake worker and is
SIGKILLed; a new supervisor on the same state directory re-adopts the worker (same pid), reads its
later events from where the first one's delivered events end, and reports its exit with the code
the worker announced, although it is not the worker's parent. A worker that vanishes without
announcing failed with an unknown code; one that ended while no supervisor ran is reported once.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import WorkerEvent
from tests.test_agent_supervisor import FAKE_WORKER, Recorder

ROOT = Path(__file__).resolve().parent.parent


class Host:
    """The first supervisor, in a process of its own; `events` are those it delivered."""

    def __init__(self, state_dir: Path, spec: dict[str, Any]) -> None:
        self.events: list[WorkerEvent] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.agent_supervisor_host", str(state_dir), json.dumps(spec)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
        )

    def wait_for(self, predicate: Callable[[list[WorkerEvent]], bool], timeout_s: float = 30.0) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        while not predicate(self.events):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; events: {[e.model_dump(exclude_none=True) for e in self.events]}"
            readable, _, _ = select.select([stdout], [], [], left)
            if readable:
                line = stdout.readline()
                assert line, f"the host exited with {self.process.wait()}"
                self.events.append(WorkerEvent.model_validate_json(line))

    def steps(self) -> list[int]:
        return [e.step for e in self.events if e.kind == "progress" and e.step is not None]

    def kill(self) -> None:
        """SIGKILLs the host, then takes the events it printed before it died: it may have said
        they were delivered (and moved its record past them) after the test last read."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        if self.process.stdout is not None:
            with self.process.stdout as stdout:
                self.events.extend(WorkerEvent.model_validate_json(line) for line in stdout if line.strip())


@pytest.fixture
def workers() -> Iterator[list[psutil.Process]]:
    """Worker processes a test saw; whatever of them is left at the end is killed (psutil checks
    that the pid still names the same process)."""
    seen: list[psutil.Process] = []
    yield seen
    for process in seen:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def gone(process: psutil.Process) -> bool:
    """Whether the process has exited (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def started_and_orphaned(
    state_dir: Path, spec: dict[str, Any], workers: list[psutil.Process]
) -> tuple[psutil.Process, list[int]]:
    """Starts the host with one worker, lets it deliver ten steps, SIGKILLs the host. Returns the
    worker and the steps the host delivered."""
    host = Host(state_dir, spec)
    try:
        host.wait_for(lambda _: any(step >= 10 for step in host.steps()))
        [started] = [e for e in host.events if e.kind == "started"]
        assert started.pid is not None
        worker = psutil.Process(started.pid)
        workers.append(worker)
    finally:
        host.kill()
    return worker, host.steps()


def supervisor_on(state_dir: Path) -> WorkerSupervisor:
    return WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0, state_dir=state_dir)
    )


def test_a_worker_outlives_its_supervisor_and_the_next_one_takes_it_back(
    tmp_path: Path, workers: list[psutil.Process]
) -> None:
    exit_file = tmp_path / "exit-now"
    spec = {"steps": 1_000_000, "step_s": 0.02, "exit_file": str(exit_file), "exit_code": 3}
    worker, delivered = started_and_orphaned(tmp_path / "state", spec, workers)
    assert not gone(worker)

    supervisor = supervisor_on(tmp_path / "state")
    try:
        running = supervisor.adopt()
        assert [(w.job_id, w.generation, w.rank, w.pid, w.device_index) for w in running] == [
            (7, 3, 0, worker.pid, 0)
        ]
        assert supervisor.running() == running
        recorder = Recorder(supervisor)
        recorder.wait_for(lambda _: any((e.step or 0) > max(delivered) + 5 for e in recorder.of("progress")))
        later = [e.step for e in recorder.of("progress") if e.step is not None]
        assert set(range(1, max(later) + 1)) == set(delivered) | set(later), "an event was lost"
        assert later[0] <= max(delivered) + 1, "the output is read on from where the delivered events end"
        assert recorder.of("started") == [] and recorder.of("exited") == []

        exit_file.touch()
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.job_id, exited.generation, exited.rank, exited.pid) == (7, 3, 0, worker.pid)
        assert (exited.exit_code, exited.reason) == (3, "failed")
        assert exited.message == "exit code 3 (failed), as it announced"
        assert exited.step == recorder.of("progress")[-1].step
        assert supervisor.running() == []
        supervisor.events_delivered()
        assert list((tmp_path / "state" / "workers").iterdir()) == [], "the record outlived its report"
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_readopted_worker_that_vanishes_without_a_word_failed_with_an_unknown_code(
    tmp_path: Path, workers: list[psutil.Process]
) -> None:
    worker, _ = started_and_orphaned(tmp_path / "state", {"steps": 1_000_000, "step_s": 0.02}, workers)
    supervisor = supervisor_on(tmp_path / "state")
    try:
        assert [w.pid for w in supervisor.adopt()] == [worker.pid]
        recorder = Recorder(supervisor)
        recorder.wait_for(lambda _: bool(recorder.of("progress")))
        worker.kill()
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.pid, exited.exit_code, exited.reason) == (worker.pid, None, "failed")
        assert exited.message is not None and exited.message.startswith("exit code unknown")
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_readopted_worker_can_be_stopped(tmp_path: Path, workers: list[psutil.Process]) -> None:
    from elastic.wire import StopCommand

    worker, _ = started_and_orphaned(tmp_path / "state", {"steps": 1_000_000, "step_s": 0.02}, workers)
    supervisor = supervisor_on(tmp_path / "state")
    try:
        supervisor.adopt()
        recorder = Recorder(supervisor)
        assert supervisor.stop(StopCommand(job_id=7, before_generation=4, reason="cancel")) == 1
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.pid, exited.exit_code, exited.reason) == (worker.pid, 75, "stopped")
        assert gone(worker)
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_worker_that_ended_while_no_supervisor_ran_is_reported_once(
    tmp_path: Path, workers: list[psutil.Process]
) -> None:
    exit_file = tmp_path / "exit-now"
    spec = {"steps": 1_000_000, "step_s": 0.02, "exit_file": str(exit_file)}
    worker, delivered = started_and_orphaned(tmp_path / "state", spec, workers)
    exit_file.touch()
    deadline = time.monotonic() + 20
    while not gone(worker):
        assert time.monotonic() < deadline, "the worker did not exit"
        time.sleep(0.02)

    supervisor = supervisor_on(tmp_path / "state")
    try:
        assert supervisor.adopt() == []
        recorder = Recorder(supervisor)
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.pid, exited.exit_code, exited.reason) == (worker.pid, 0, "completed")
        assert exited.message == "exit code 0 (completed), as it announced"
        assert exited.step is not None and exited.step >= max(delivered)
        supervisor.events_delivered()
    finally:
        supervisor.shutdown(grace_s=1.0)
    again = supervisor_on(tmp_path / "state")
    assert again.adopt() == [] and again.drain_events() == []
