"""The worker supervisor with real worker processes: tests/agent_fake_worker.py (no torch, told
by its spec how to behave) for the lifecycle and the generation rules (a newer generation starts
only its joiners; survivors are never stopped; a leaver that stays is killed after its grace),
and the real `python -m elastic.worker` once, end to end on one CPU slot."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.devices import WorkerPlacement, make_backend
from agent.devices.simulated import SimulatedBackend
from agent.spawn import socket_interface_env
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from agent.worker_process import exit_reason, settle_exit
from elastic.wire import (
    WORKER_EVENT_PREFIX,
    LaunchCommand,
    Member,
    Membership,
    StopCommand,
    WorkerAssignment,
    WorkerEvent,
)

FAKE_WORKER = "tests.agent_fake_worker"
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


class Recorder:
    """Collects a supervisor's events across drains."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self.supervisor = supervisor
        self.events: list[WorkerEvent] = []

    def wait_for(self, predicate: Callable[[list[WorkerEvent]], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.events += self.supervisor.drain_events()
            if predicate(self.events):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out; events: {[e.model_dump(exclude_none=True) for e in self.events]}"
                )
            time.sleep(0.02)

    def of(self, kind: str, generation: int | None = None) -> list[WorkerEvent]:
        return [
            e for e in self.events if e.kind == kind and (generation is None or e.generation == generation)
        ]

    def exits(self, count: int, generation: int | None = None) -> Callable[[list[WorkerEvent]], bool]:
        return lambda _: len(self.of("exited", generation)) >= count


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend(slots=2)


@pytest.fixture
def supervisor() -> Iterator[WorkerSupervisor]:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0))
    yield supervisor
    supervisor.shutdown(grace_s=1.0)


def launch(
    generation: int = 1, ranks: int = 1, job_id: int = 1, start: list[int] | None = None, **spec: Any
) -> LaunchCommand:
    """A launch of `ranks` workers on devices 0.., starting those in `start` (default: all)."""
    starting = list(range(ranks)) if start is None else start
    return LaunchCommand(
        job_id=job_id,
        generation=generation,
        world_size=ranks,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=[WorkerAssignment(rank=rank, device_index=rank) for rank in starting],
        members=list(range(ranks)),
        spec=spec,
        run_dir="/tmp/bungee-agent-test",
        coordination_key=f"bungee-agent-test:job:{job_id}",
        redis_url=REDIS_URL,
    )


def test_launch_starts_each_worker_and_reports_what_it_does(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    assert supervisor.launch(launch(ranks=2, steps=3), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(2))
    for rank in (0, 1):
        mine = [e for e in recorder.events if e.rank == rank]
        assert [e.kind for e in mine][0] == "started" and [e.kind for e in mine][-1] == "exited"
        started, exited = mine[0], mine[-1]
        assert started.device_index == rank and started.pid is not None
        assert [e.step for e in mine if e.kind == "progress"] == [1, 2, 3]
        assert (exited.exit_code, exited.reason, exited.step, exited.pid) == (0, "completed", 3, started.pid)
        core = sorted(os.sched_getaffinity(0))[rank]
        assert f"fake worker rank={rank} device=cpu cuda=None omp=1 affinity={core}" in [
            e.message for e in mine if e.kind == "log"
        ]
        # A line behind the prefix that is not an event arrives as a log line.
        assert f"{WORKER_EVENT_PREFIX}{{not json" in [e.message for e in mine]
    assert {(e.job_id, e.generation) for e in recorder.events} == {(1, 1)}
    assert supervisor.running() == []


def test_running_lists_live_workers(supervisor: WorkerSupervisor, backend: SimulatedBackend) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(ranks=2, job_id=3, generation=4), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 2)
    running = sorted(supervisor.running(), key=lambda w: w.rank)
    assert [(w.job_id, w.generation, w.rank, w.device_index) for w in running] == [(3, 4, 0, 0), (3, 4, 1, 1)]
    assert [w.pid for w in running] == [e.pid for e in sorted(recorder.of("started"), key=lambda e: e.rank)]
    assert all(psutil.pid_exists(w.pid) for w in running)


def test_the_same_generation_twice_starts_nothing_more(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    assert supervisor.launch(launch(generation=2), backend, REDIS_URL)
    assert not supervisor.launch(launch(generation=2), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("progress")) >= 3)
    assert len(recorder.of("started")) == 1 and len(supervisor.running()) == 1


def test_a_newer_generation_starts_only_its_joiners_and_keeps_the_survivors(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(generation=1), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("progress", 1)) >= 1)
    [survivor] = recorder.of("started", 1)
    assert supervisor.launch(launch(generation=2, ranks=2, start=[1]), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started", 2)) == 1)
    [joiner] = recorder.of("started", 2)
    assert joiner.rank == 1 and joiner.device_index == 1
    assert recorder.of("exited") == [], "the survivor was not touched"
    assert sorted(w.pid for w in supervisor.running()) == sorted([survivor.pid, joiner.pid])


def test_a_survivor_that_joins_a_generation_is_reported_under_it_with_its_pid(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(
        launch(generation=1, ranks=2, steps=3, joins_at_step=2, joins_generation=4), backend, REDIS_URL
    )
    recorder.wait_for(recorder.exits(2))
    joined = recorder.of("joined", 4)
    assert sorted((e.rank, e.device_index) for e in joined) == [(0, 0), (1, 1)]
    started = {e.rank: e.pid for e in recorder.of("started", 1)}
    assert {e.rank: e.pid for e in joined} == started
    assert {(e.generation, e.rank, e.pid) for e in recorder.of("exited")} == {
        (4, r, p) for r, p in started.items()
    }


def test_a_device_a_newer_generation_keeps_gets_no_second_worker(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(generation=1), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 1)
    assert supervisor.launch(launch(generation=2), backend, REDIS_URL)  # lists device 0 again
    time.sleep(0.3)
    recorder.wait_for(lambda _: True)
    assert len(recorder.of("started")) == 1 and len(supervisor.running()) == 1


def test_a_worker_counted_on_to_join_that_exits_instead_gets_its_joiner_started(
    supervisor: WorkerSupervisor, backend: SimulatedBackend, tmp_path: Path
) -> None:
    """A node that was cut off comes back with its old worker still running; the portal, which
    gave that worker up, asks for a joiner on its device. The agent leaves the device to the old
    worker, which may join; but if it leaves the job instead (it read the generation before),
    the joiner starts then rather than never (the generation would wait out its deadline)."""
    recorder = Recorder(supervisor)
    leave = tmp_path / "leave"
    supervisor.launch(launch(generation=1, exit_file=str(leave), exit_code=76), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 1)
    assert supervisor.launch(launch(generation=3), backend, REDIS_URL)  # a joiner on device 0
    time.sleep(0.3)
    recorder.wait_for(lambda _: True)
    assert len(recorder.of("started")) == 1, "the worker already there may join"
    leave.touch()
    recorder.wait_for(lambda _: len(recorder.of("started")) == 2)
    [old, new] = recorder.of("started")
    assert (old.generation, new.generation, new.device_index) == (1, 3, 0)
    assert [e.exit_code for e in recorder.of("exited")] == [76]


def test_a_worker_that_joins_the_newer_generation_is_not_doubled(
    supervisor: WorkerSupervisor, backend: SimulatedBackend, tmp_path: Path
) -> None:
    recorder = Recorder(supervisor)
    leave = tmp_path / "leave"
    supervisor.launch(
        launch(generation=1, exit_file=str(leave), joins_at_step=20, joins_generation=3), backend, REDIS_URL
    )
    assert supervisor.launch(launch(generation=3), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("joined", 3)) == 1)
    leave.touch()  # it joined generation 3 and ends later: nothing to start for it
    recorder.wait_for(recorder.exits(1))
    time.sleep(0.3)
    recorder.wait_for(lambda _: True)
    assert len(recorder.of("started")) == 1


def test_a_leaver_that_does_not_leave_is_killed_after_its_grace(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, leave_grace_s=0.5))
    recorder = Recorder(supervisor)
    try:
        # Members that joined their group (and so may hold the state), as every real one has.
        supervisor.launch(launch(generation=1, ranks=2, joins_at_step=1, joins_generation=1), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("joined", 1)) == 2)
        supervisor.launch(launch(generation=2, ranks=1, start=[]), backend, REDIS_URL)
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.rank, exited.exit_code, exited.reason) == (1, -9, "failed")
        assert exited.message == "killed by SIGKILL after did not leave within 0.5 s of generation 2"
        assert [w.rank for w in supervisor.running()] == [0]
    finally:
        supervisor.shutdown(grace_s=0.5)


def test_a_leaver_taken_back_by_a_newer_generation_is_spared(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, leave_grace_s=0.5))
    recorder = Recorder(supervisor)
    try:
        supervisor.launch(launch(generation=1, ranks=2), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("started", 1)) == 2)
        supervisor.launch(launch(generation=2, ranks=1, start=[]), backend, REDIS_URL)
        supervisor.launch(launch(generation=3, ranks=2, start=[]), backend, REDIS_URL)
        time.sleep(1.0)
        recorder.wait_for(lambda _: True)
        assert recorder.of("exited") == [] and len(supervisor.running()) == 2
    finally:
        supervisor.shutdown(grace_s=0.5)


def test_an_older_generation_arriving_late_is_ignored(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(generation=3), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 1)
    assert not supervisor.launch(launch(generation=2), backend, REDIS_URL)
    time.sleep(0.3)
    recorder.wait_for(lambda _: True)
    assert [e.generation for e in recorder.of("started")] == [3]
    assert recorder.of("exited") == []


def test_generations_are_tracked_per_job(supervisor: WorkerSupervisor, backend: SimulatedBackend) -> None:
    recorder = Recorder(supervisor)
    assert supervisor.launch(launch(job_id=1, generation=5), backend, REDIS_URL)
    assert supervisor.launch(launch(job_id=2, generation=1), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 2)
    assert {e.job_id for e in recorder.of("started")} == {1, 2}


def test_stop_ends_the_older_workers_and_a_late_launch_below_it_is_ignored(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(generation=1, ranks=2), backend, REDIS_URL)
    recorder.wait_for(lambda _: {e.rank for e in recorder.of("progress")} == {0, 1})
    assert supervisor.stop(StopCommand(job_id=1, before_generation=3, reason="cancel")) == 2
    recorder.wait_for(recorder.exits(2))
    for exited in recorder.of("exited"):
        assert (exited.exit_code, exited.reason) == (75, "stopped")
        assert exited.step is not None and exited.step >= 1
        assert exited.message == "exit code 75 (stopped) after stop (cancel)"
    assert not supervisor.launch(launch(generation=2), backend, REDIS_URL)
    assert supervisor.launch(launch(generation=3), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started", 3)) == 1)


def test_stop_leaves_newer_generations_and_other_jobs_alone(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(job_id=1, generation=2), backend, REDIS_URL)
    supervisor.launch(launch(job_id=2, generation=1), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 2)
    assert supervisor.stop(StopCommand(job_id=1, before_generation=2)) == 0
    assert supervisor.stop(StopCommand(job_id=3, before_generation=9)) == 0
    assert len(supervisor.running()) == 2


def test_a_crash_is_a_failure_with_its_exit_code(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(steps=10, crash_at_step=3, crash_code=3), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason, exited.step) == (3, "failed", 2)
    assert "fake worker crashing" in [e.message for e in recorder.of("log")]


def test_what_the_jobs_code_raised_goes_with_the_exit(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    """The worker's "exiting" line names the job's code's failure; the agent keeps it (in the
    worker's record too, for an agent that re-adopts it) and reports it in "exited"."""
    recorder = Recorder(supervisor)
    supervisor.launch(launch(steps=10, user_error_at_step=2), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason, exited.step) == (77, "user_error", 1)
    assert exited.user_error is not None and exited.user_error.error == "loss() raised ValueError: fake"
    assert exited.user_error.traceback == '  File "task.py", line 9'
    assert not recorder.of("exiting"), "the announcement itself is the agent's, not reported"


def test_a_worker_killed_by_a_signal_failed(supervisor: WorkerSupervisor, backend: SimulatedBackend) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("started")) == 1)
    os.kill(recorder.of("started")[0].pid or 0, 9)
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason, exited.message) == (-9, "failed", "killed by SIGKILL")


def test_a_worker_that_never_joined_gets_the_short_grace(backend: SimulatedBackend) -> None:
    """A joiner that hangs while warming up holds no state: it is killed after the warming grace,
    while a worker that joined keeps the full one to save its state."""
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=3.0, warming_stop_grace_s=0.3)
    )
    recorder = Recorder(supervisor)
    try:
        supervisor.launch(launch(ranks=2, sigterm="ignore", joins_at_step=1, joins_generation=1, start=[0]),
                          backend, REDIS_URL)
        supervisor.launch(launch(generation=2, ranks=2, sigterm="ignore", start=[1]), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("joined")) == 1 and len(recorder.of("progress", 2)) >= 1)
        assert supervisor.stop(StopCommand(job_id=1, before_generation=3, reason="cancel")) == 2
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.generation, exited.exit_code) == (2, -9), "the warming one goes first"
        assert exited.reason == "stopped", "it held nothing: a stop, not a crash"
        assert len(supervisor.running()) == 1, "the joined one still has its grace period"
    finally:
        supervisor.shutdown(grace_s=0.5)


def test_an_agent_shutting_down_gives_a_worker_that_never_joined_the_short_grace(backend: SimulatedBackend) -> None:
    """The agent's SIGTERM stops its workers as a cancel does: a warming one that ignores the
    signal is killed after the warming grace, not the full one (found where a platform's agent
    took more than 20 s to stop beside a joiner caught forming its group)."""
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=30.0, warming_stop_grace_s=0.3)
    )
    recorder = Recorder(supervisor)
    supervisor.launch(launch(generation=1, ranks=1, sigterm="ignore"), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("progress", 1)) >= 1)
    began = time.monotonic()
    supervisor.shutdown()
    took = time.monotonic() - began
    recorder.wait_for(recorder.exits(1), timeout_s=1.0)  # shutdown returns once it has exited
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason) == (-9, "stopped"), exited
    assert took < 10.0, f"shutdown waited {took:.1f} s: the full grace (30 s), not the warming one (0.3 s)"


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=0.5))
    recorder = Recorder(supervisor)
    try:
        supervisor.launch(launch(sigterm="ignore", joins_at_step=1, joins_generation=1), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("joined")) >= 1)
        supervisor.stop(StopCommand(job_id=1, before_generation=2))
        recorder.wait_for(recorder.exits(1))
        [exited] = recorder.of("exited")
        assert (exited.exit_code, exited.reason) == (-9, "failed")
        assert exited.message == "killed by SIGKILL after stop (resize)"
    finally:
        supervisor.shutdown(grace_s=0.5)


def test_a_worker_that_dies_of_the_sigterm_it_was_sent_stopped(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(sigterm="die"), backend, REDIS_URL)
    recorder.wait_for(lambda _: len(recorder.of("progress")) >= 1)
    supervisor.stop(StopCommand(job_id=1, before_generation=2))
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason) == (-15, "stopped")
    assert exited.message == "killed by SIGTERM after stop (resize)"


def test_children_a_worker_leaves_behind_are_ended(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(steps=2, child=True), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [line] = [e.message or "" for e in recorder.of("log") if (e.message or "").startswith("child pid=")]
    child_pid = int(line.removeprefix("child pid="))
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child_pid) and psutil.Process(child_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker's child outlived it"
        time.sleep(0.05)
    assert recorder.of("exited")[0].reason == "completed"


def test_a_device_the_node_lacks_fails_that_worker_without_starting_it(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    command = launch(ranks=3, steps=1)  # device 2 is not on a two-slot node
    supervisor.launch(command, backend, REDIS_URL)
    recorder.wait_for(recorder.exits(3))
    failed = [e for e in recorder.of("exited") if e.reason == "failed"]
    assert [(e.rank, e.device_index, e.exit_code) for e in failed] == [(2, 2, None)]
    assert "device index 2 is not on this node" in (failed[0].message or "")
    assert sorted(e.rank for e in recorder.of("started")) == [0, 1]


def test_a_worker_module_that_does_not_exist_fails(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module="tests.no_such_worker"))
    recorder = Recorder(supervisor)
    supervisor.launch(launch(), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason) == (1, "failed")
    assert any("No module named tests.no_such_worker" in (e.message or "") for e in recorder.of("log"))
    supervisor.shutdown()


def test_shutdown_stops_every_worker_and_refuses_new_launches(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0))
    recorder = Recorder(supervisor)
    supervisor.launch(launch(job_id=1, ranks=2), backend, REDIS_URL)
    supervisor.launch(launch(job_id=2), backend, REDIS_URL)
    recorder.wait_for(
        lambda _: {(e.job_id, e.rank) for e in recorder.of("progress")} == {(1, 0), (1, 1), (2, 0)}
    )
    supervisor.shutdown()
    assert supervisor.running() == []
    recorder.wait_for(recorder.exits(3))
    assert {(e.exit_code, e.reason) for e in recorder.of("exited")} == {(75, "stopped")}
    assert not supervisor.launch(launch(job_id=3), backend, REDIS_URL)


class GatedBackend(SimulatedBackend):
    """A node whose placement of a worker, the first step of its spawn, waits until the test
    opens `gate`: a spawn in progress for as long as the test wants (with a deadline, so that a
    test that never opens it fails rather than hangs)."""

    def __init__(self) -> None:
        super().__init__(slots=2)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.left = threading.Event()

    def placement(self, index: int) -> WorkerPlacement:
        self.entered.set()
        self.gate.wait(timeout=60)
        self.left.set()
        return super().placement(index)


def test_a_spawn_in_progress_holds_up_no_report_and_a_stop_meanwhile_reaches_its_worker() -> None:
    backend = GatedBackend()
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0))
    recorder = Recorder(supervisor)
    launched: list[bool] = []
    spawning = threading.Thread(target=lambda: launched.append(supervisor.launch(launch(), backend, REDIS_URL)))
    try:
        spawning.start()
        assert backend.entered.wait(timeout=60), "the spawn never began"
        # The agent's report loop asks these while the spawn waits: they answer at once.
        assert supervisor.running() == [], "a worker being spawned has no pid to report yet"
        assert supervisor.drain_events() == []
        assert supervisor.stop(StopCommand(job_id=1, before_generation=2, reason="cancel")) == 1
        assert not backend.left.is_set(), "the report path waited for the spawn"
        backend.gate.set()
        spawning.join(timeout=60)
        assert launched == [True]
        recorder.wait_for(recorder.exits(1))
        [started] = recorder.of("started")
        [exited] = recorder.of("exited")
        assert exited.pid == started.pid and exited.reason == "stopped", exited
        assert (exited.message or "").endswith("after stop (cancel)"), exited
        assert supervisor.running() == []
    finally:
        backend.gate.set()
        supervisor.shutdown(grace_s=1.0)


# --- exit codes (the worker's output lines: tests/test_worker_event_codec.py) -----------------


@pytest.mark.parametrize(
    ("code", "stop_requested", "joined", "reason"),
    [
        (0, False, True, "completed"),
        (75, False, True, "stopped"),
        (1, False, True, "failed"),
        (3, True, True, "failed"),
        (-15, False, True, "failed"),
        (-15, True, True, "stopped"),
        (-15, True, False, "stopped"),
        (-9, True, True, "failed"),  # it held the state and did not save it within its grace
        (-9, True, False, "stopped"),  # still warming up when its short grace ran out
        (-9, False, False, "failed"),  # nobody asked it to stop
        (3, True, False, "failed"),
    ],
)
def test_exit_reasons(code: int, stop_requested: bool, joined: bool, reason: str) -> None:
    assert exit_reason(code, stop_requested, joined) == reason


@pytest.mark.parametrize(
    ("status", "announced", "stop_requested", "finished", "outcome"),
    [
        (0, 0, None, False, (0, "completed", "exit code 0 (completed)")),
        (-15, None, "stop (resize)", False, (-15, "stopped", "killed by SIGTERM after stop (resize)")),
        # The "finished" stop's SIGTERM lands in the teardown of a worker that completed.
        (
            -15,
            0,
            "stop (finished)",
            False,
            (
                0,
                "completed",
                "exit code 0 (completed); then killed by SIGTERM in its teardown after stop (finished)",
            ),
        ),
        (
            -9,
            75,
            "stop (cancel)",
            False,
            (
                75,
                "stopped",
                "exit code 75 (stopped); then killed by SIGKILL in its teardown after stop (cancel)",
            ),
        ),
        (1, 0, None, False, (1, "failed", "exit code 1 (failed)")),
        (
            -15,
            None,
            "stop (finished)",
            True,
            (-15, "completed", "killed by SIGTERM after stop (finished), after the job's last step"),
        ),
        (None, 3, None, False, (3, "failed", "exit code 3 (failed), as it announced")),
        (None, None, None, True, (None, "completed", "exit code unknown; its last step was the job's last")),
    ],
)
def test_exit_outcomes(
    status: int | None,
    announced: int | None,
    stop_requested: str | None,
    finished: bool,
    outcome: tuple[Any, ...],
) -> None:
    settled = settle_exit(status, announced, stop_requested, finished)
    assert (settled.exit_code, settled.reason, settled.message) == outcome


def test_an_exit_of_unknown_code_without_a_word_failed() -> None:
    settled = settle_exit(None, None)
    assert (settled.exit_code, settled.reason) == (None, "failed")
    assert settled.message.startswith("exit code unknown")


def test_a_worker_that_completed_is_not_made_stopped_by_the_finished_stop_in_its_teardown(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    recorder = Recorder(supervisor)
    supervisor.launch(launch(steps=3, teardown_s=30), backend, REDIS_URL)
    recorder.wait_for(lambda _: "tearing down" in [e.message for e in recorder.of("log")])
    supervisor.stop(StopCommand(job_id=1, before_generation=2, reason="finished"))
    recorder.wait_for(recorder.exits(1))
    [exited] = recorder.of("exited")
    assert (exited.exit_code, exited.reason, exited.step) == (0, "completed", 3)
    assert (
        exited.message
        == "exit code 0 (completed); then killed by SIGTERM in its teardown after stop (finished)"
    )


# --- the real worker -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("start", ["cold", "standby", "forked standby"])
def test_the_real_worker_trains_and_stops_on_a_cpu_slot(tmp_path: Path, start: str) -> None:
    """Started cold, by a warm standby that takes the launch (agent.standby), and by one forked
    from the node's fork server (elastic.worker.forkserver): its exit code comes from there."""
    from elastic.membership.redis import RedisBoard

    standbys = start != "cold"
    supervisor = WorkerSupervisor(
        SupervisorConfig(
            stop_grace_s=60.0, node_name="node-t", standbys=1 if standbys else 0, fork_standbys=start == "forked standby"
        )
    )
    backend = make_backend("simulated", slots=1)
    supervisor.keep_standbys(backend, set())
    if start == "forked standby":  # none until the fork server has imported the runtime
        assert supervisor.standby_pids() == {}
        deadline = time.monotonic() + 120
        while not supervisor.standby_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
            supervisor.keep_standbys(backend, set())
    standby_pids = list(supervisor.standby_pids())
    assert len(standby_pids) == (1 if standbys else 0)
    if start == "forked standby":
        assert psutil.Process(standby_pids[0]).ppid() != os.getpid(), "forked by the fork server, not by us"
    recorder = Recorder(supervisor)
    spec = {"name": "agent-test", "workload": "digits-mlp", "steps": 100_000, "seed": 1}
    key = f"bungee-agent-test-{os.getpid()}:job:9"
    command = LaunchCommand(
        job_id=9,
        generation=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        workers=[WorkerAssignment(rank=0, device_index=0)],
        members=[0],
        spec=spec,
        run_dir=str(tmp_path),
        coordination_key=key,
        redis_url=REDIS_URL,
    )
    board = RedisBoard.connect(REDIS_URL, key)
    board.publish(
        Membership(
            job_id=9,
            generation=1,
            master_addr="127.0.0.1",
            master_port=command.master_port,
            has_state=False,
            members=[Member(node="node-t", device_index=0, address="127.0.0.1", joiner=True)],
        )
    )
    try:
        assert supervisor.launch(command, backend, REDIS_URL)
        recorder.wait_for(lambda _: bool(recorder.of("progress")) or bool(recorder.of("exited")), 120)
        assert recorder.of("exited") == [], [e.message for e in recorder.of("log")]
        pid = recorder.of("started")[0].pid
        assert (pid in standby_pids) == standbys
        # A worker from a standby (which waited at SCHED_IDLE) runs at the normal policy, every thread.
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")} == {os.SCHED_OTHER}
        [joined] = recorder.of("joined")
        assert (joined.generation, joined.rank, joined.pid) == (1, 0, recorder.of("started")[0].pid)
        progress = recorder.of("progress")[0]
        assert (progress.job_id, progress.generation, progress.rank, progress.total_steps) == (
            9,
            1,
            0,
            100_000,
        )
        supervisor.stop(StopCommand(job_id=9, before_generation=2))
        recorder.wait_for(recorder.exits(1), 60)
        [exited] = recorder.of("exited")
        assert (exited.exit_code, exited.reason) == (75, "stopped"), [e.message for e in recorder.of("log")]
        assert exited.step is not None and exited.step >= 1
    finally:
        supervisor.shutdown(grace_s=5.0)
        for stale in board.client.scan_iter(f"{key}:*"):
            board.client.delete(stale)
        board.close()


def test_workers_listen_on_the_interface_that_holds_the_nodes_address() -> None:
    # gloo otherwise listens where the host name resolves (often 127.0.0.1): peers on other
    # hosts could not connect (tests/test_multihost.py shows it across namespaces).
    assert socket_interface_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    assert socket_interface_env("192.0.2.77", {}) == {}, "an address no interface holds (TEST-NET-1)"
    assert socket_interface_env("no-such-host.invalid", {}) == {}
