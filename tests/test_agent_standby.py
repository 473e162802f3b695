"""Warm standby workers (agent.standby, elastic.worker.standby) with real processes: a standby on
each free device, a launch that takes it (same pid, the worker's output, environment and CPU
core), a standby that serves one worker only, none on a device whose owner is back, none used
when the device's placement changed, none left after the agent's shutdown or death, their
pids told while a spawn holds the pool and while its worker is handed over, and a standby left to
the spawn that is about to take it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.devices.nvml import GpuProcess, classify_processes
from agent.devices.simulated import SimulatedBackend
from agent.records import RecordStore
from agent.spawn import WorkerSpawner
from agent.standby import Standby, StandbyPool, StandbyState
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import StopCommand
from elastic.worker.forkserver import ForkedProcess
from elastic.worker.standby import PREPARED_LINE
from tests.agent_fake_worker import JOINS_ENV
from tests.test_agent_supervisor import FAKE_WORKER, REDIS_URL, Recorder, launch

WARM_S = 120.0
"""A standby imports torch: seconds on a quiet machine, more on a loaded one."""


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float = WARM_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def warmed(pool: StandbyPool, standby: Standby) -> Callable[[], bool]:
    """Whether `standby` is warm, as the pool sees it now."""
    return lambda: standby in pool.standbys() and standby.ready()


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend(slots=2)


@pytest.fixture(params=["exec", "fork"])
def supervisor(request: pytest.FixtureRequest) -> Iterator[WorkerSupervisor]:
    """With standbys started as processes of their own, and forked from the node's fork server."""
    supervisor = WorkerSupervisor(
        SupervisorConfig(
            worker_module=FAKE_WORKER, stop_grace_s=5.0, standbys=8, fork_standbys=request.param == "fork"
        )
    )
    yield supervisor
    supervisor.shutdown(grace_s=1.0)


def warm(
    supervisor: WorkerSupervisor, backend: SimulatedBackend, taken: set[int] | None = None, count: int = 2
) -> dict[int, int]:
    """Keeps the standbys, as the agent does after each report, until `count` are warm (they
    start one at a time); returns device index -> pid."""
    pool = supervisor._spawner.standbys
    assert pool is not None

    def all_warm() -> bool:
        supervisor.keep_standbys(backend, taken or set())
        standbys = pool.standbys()
        return len(standbys) == count and all(standby.ready() for standby in standbys)

    wait_until(f"{count} warm standbys", all_warm)
    return {index: pid for pid, index in supervisor.standby_pids().items()}


def test_a_launch_takes_the_devices_standby_which_serves_that_worker_only(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    standbys = warm(supervisor, backend)
    assert sorted(standbys) == [0, 1]
    assert {os.sched_getscheduler(pid) for pid in standbys.values()} == {os.SCHED_IDLE}  # idle CPU only
    recorder = Recorder(supervisor)
    assert supervisor.launch(launch(ranks=1, steps=3), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [started] = recorder.of("started")
    [exited] = recorder.of("exited")
    # The standby became the worker: same process, the worker's output and environment (its
    # config, one OpenMP thread) and its device's core.
    assert started.pid == standbys[0]
    assert (exited.exit_code, exited.reason, exited.step) == (0, "completed", 3)
    core = sorted(os.sched_getaffinity(0))[0]
    assert f"fake worker rank=0 device=cpu cuda=None omp=1 affinity={core}" in [
        e.message for e in recorder.of("log")
    ]
    assert [e.step for e in recorder.of("progress")] == [1, 2, 3]
    assert supervisor.standby_pids() == {standbys[1]: 1}
    # The worker's environment went down the pipe: nothing of it is on disk.
    assert not [p for p in (supervisor.state_dir / "standby").iterdir() if b"BUNGEE_WORKER_CONFIG" in p.read_bytes()]
    # The device is free again: it gets a new standby, never the one that served the job.
    supervisor.keep_standbys(backend, set())
    [(fresh, index)] = [(pid, i) for pid, i in supervisor.standby_pids().items() if i == 0]
    assert fresh != standbys[0]
    assert gone(standbys[0])


def test_a_taken_standby_is_ours_in_every_report_until_its_worker_is_listed(
    supervisor: WorkerSupervisor, backend: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report asks for the standbys, then for the running workers. Between a spawn's take and
    the supervisor listing the worker, the process was in neither: on a GPU, an unknown process on
    the device, read as its owner's return (the device taken back from the job it just joined)."""
    standbys = warm(supervisor, backend)
    spawn = supervisor._spawner.spawn
    told: list[bool] = []

    def spawn_then_report(*args: Any) -> Any:
        spawned = spawn(*args)  # taken, not listed yet
        pid = spawned.process.pid
        told.append(pid in supervisor.standby_pids() or pid in {w.pid for w in supervisor.running()})
        return spawned

    monkeypatch.setattr(supervisor._spawner, "spawn", spawn_then_report)
    assert supervisor.launch(launch(ranks=1, steps=1000), backend, REDIS_URL)
    assert told == [True]
    [worker] = supervisor.running()
    assert worker.pid == standbys[0] and worker.pid not in supervisor.standby_pids()


def test_a_device_whose_owner_is_back_loses_its_standby(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    standbys = warm(supervisor, backend)
    supervisor.keep_standbys(backend, {1})
    assert supervisor.standby_pids() == {standbys[0]: 0}
    wait_until("the owner's device's standby to die", lambda: gone(standbys[1]), 10)
    assert not gone(standbys[0])


def test_a_device_running_a_cold_worker_has_no_standby(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, standbys=8))
    try:
        assert supervisor.launch(launch(ranks=1, steps=1000), backend, REDIS_URL)
        supervisor.keep_standbys(backend, set())
        assert set(supervisor.standby_pids().values()) == {1}
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_standby_started_for_another_placement_is_not_used(
    supervisor: WorkerSupervisor, backend: SimulatedBackend
) -> None:
    standbys = warm(supervisor, backend)
    backend.set_slowdown(0, 3.0)  # a worker started on device 0 from now on needs another environment
    recorder = Recorder(supervisor)
    assert supervisor.launch(launch(ranks=1, steps=2), backend, REDIS_URL)
    recorder.wait_for(recorder.exits(1))
    [started] = recorder.of("started")
    assert started.pid != standbys[0]
    assert recorder.of("exited")[0].reason == "completed"
    wait_until("the unused standby to die", lambda: gone(standbys[0]), 10)


def test_shutdown_kills_the_standbys(backend: SimulatedBackend) -> None:
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, standbys=8))
    pids = list(warm(supervisor, backend).values())
    assert len(pids) == 2
    supervisor.shutdown(grace_s=1.0)
    assert all(gone(pid) for pid in pids)
    supervisor.keep_standbys(backend, set())
    assert supervisor.standby_pids() == {}


def test_a_standby_whose_agent_is_gone_exits(tmp_path: os.PathLike[str], backend: SimulatedBackend) -> None:
    import sys

    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=1)  # type: ignore[arg-type]
    pool.keep({0: backend.placement(0)}, dict(os.environ))
    [standby] = pool.standbys()
    assert standby.process.stdin is not None
    standby.process.stdin.close()  # what the agent's death does to the pipe
    assert standby.process.wait(timeout=WARM_S) == 0


def test_a_standby_is_ours_on_a_gpu_not_an_owners() -> None:
    processes, owner_present = classify_processes(
        [GpuProcess(pid=4242, memory_bytes=300 << 20)], {4242: None}, lambda pid: "python"
    )
    assert not owner_present
    assert processes[0].ours and processes[0].job_id is None


def test_an_assignment_too_large_for_the_pipe_starts_the_worker_cold(
    tmp_path: os.PathLike[str], backend: SimulatedBackend
) -> None:
    import sys

    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=1)  # type: ignore[arg-type]
    pool.keep({0: backend.placement(0)}, dict(os.environ))
    [standby] = pool.standbys()
    huge = {"BUNGEE_WORKER_CONFIG": "x" * (4 << 20)}
    assert pool.take(0, backend.placement(0), tmp_path / "out", huge, 1) is None  # type: ignore[operator]
    assert pool.standbys() == []
    assert standby.process.wait(timeout=10) != 0  # killed, never half-assigned


def test_standbys_start_one_at_a_time_up_to_the_limit(tmp_path: os.PathLike[str]) -> None:
    """A scale-in that frees many devices must not make a node import torch in many processes at
    once (a 1,024-device simulated node once started hundreds and thrashed): the next standby
    starts once the last is warm, lowest device first, and no more than the limit are kept."""
    import sys

    backend = SimulatedBackend(slots=3)
    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=2)  # type: ignore[arg-type]
    free = {index: backend.placement(index) for index in range(3)}
    try:
        pool.keep(free, dict(os.environ))
        [first] = pool.standbys()
        assert first.device_index == 0
        if not first.ready():
            pool.keep(free, dict(os.environ))
            assert pool.standbys() == [first], "a second started while the first was still warming up"
        wait_until("the first standby to warm up", warmed(pool, first))
        pool.keep(free, dict(os.environ))
        assert [s.device_index for s in pool.standbys()] == [0, 1]
        wait_until("the second standby to warm up", lambda: all(s.ready() for s in pool.standbys()))
        pool.keep(free, dict(os.environ))
        assert [s.device_index for s in pool.standbys()] == [0, 1], "the limit is 2"
    finally:
        pool.close()


def test_forked_standbys_start_together_once_the_fork_server_is_ready(tmp_path: os.PathLike[str]) -> None:
    """Forked standbys import nothing: once the fork server has imported the runtime (none
    starts before), every free device up to the limit gets one at once, each the fork server's
    child."""
    import sys

    backend = SimulatedBackend(slots=3)
    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=2, fork=True)  # type: ignore[arg-type]
    free = {index: backend.placement(index) for index in range(3)}
    try:
        pool.keep(free, dict(os.environ))
        server = pool._forkserver
        assert server is not None and pool.standbys() == [], "none before the fork server is ready"
        assert server.wait_ready()
        pool.keep(free, dict(os.environ))
        standbys = pool.standbys()
        assert [s.device_index for s in standbys] == [0, 1], "both at once, up to the limit of 2"
        assert {psutil.Process(s.pid).ppid() for s in standbys} == {server.process.pid}
        wait_until("both standbys to warm up", lambda: all(s.ready() for s in pool.standbys()))
    finally:
        pool.close()
        pool.close_forkserver()


def test_a_gpus_standby_starts_on_its_own_and_starts_no_fork_server(tmp_path: os.PathLike[str]) -> None:
    """A GPU's standby is never forked: on a node whose free devices are GPUs, the pool starts
    no fork server and does not wait for one; the standby starts as a process of its own."""
    import sys

    from agent.devices import WorkerPlacement

    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=1, fork=True)  # type: ignore[arg-type]
    gpu = WorkerPlacement(device="cuda:0", env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        pool.keep({0: gpu}, dict(os.environ))
        [standby] = pool.standbys()
        assert pool._forkserver is None and not isinstance(standby.process, ForkedProcess)
        assert psutil.Process(standby.pid).ppid() == os.getpid()
    finally:
        pool.close()


def test_a_worker_asked_for_while_the_fork_server_imports_waits_for_it(backend: SimulatedBackend) -> None:
    """A node that has just arrived: its fork server is still importing when the first launch
    comes. The worker is forked once the server is ready, not started as a second interpreter
    importing the same libraries beside it."""
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0, standbys=2, fork_standbys=True)
    )
    try:
        supervisor.keep_standbys(backend, set())  # the agent's warm-up: the fork server starts importing
        pool = supervisor._spawner.standbys
        assert pool is not None and pool._forkserver is not None and not pool._forkserver.ready
        server_pid = pool._forkserver.process.pid
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=1, steps=200), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("started")) == 1)
        [started] = recorder.of("started")
        assert started.pid is not None and psutil.Process(started.pid).ppid() == server_pid
        recorder.wait_for(recorder.exits(1))
        assert [e.reason for e in recorder.of("exited")] == ["completed"]
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_worker_no_standby_serves_is_forked_too(backend: SimulatedBackend) -> None:
    """With one standby (on device 0) and a job of two, rank 1 has none on its device: it is
    forked from the node's fork server rather than started as a new interpreter, and its end is
    reported through it."""
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0, standbys=1, fork_standbys=True)
    )
    try:
        standbys = warm(supervisor, backend, count=1)
        assert supervisor._spawner.standbys is not None and supervisor._spawner.standbys._forkserver is not None
        server_pid = supervisor._spawner.standbys._forkserver.process.pid
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=2, steps=200), backend, REDIS_URL)
        recorder.wait_for(lambda _: len(recorder.of("started")) == 2)
        pids = {event.rank: event.pid for event in recorder.of("started")}
        assert pids[0] == standbys[0], "rank 0 took device 0's standby"
        assert psutil.Process(pids[1]).ppid() == server_pid, "rank 1 was forked, no standby being on device 1"
        recorder.wait_for(recorder.exits(2))
        assert {(e.rank, e.reason) for e in recorder.of("exited")} == {(0, "completed"), (1, "completed")}
    finally:
        supervisor.shutdown(grace_s=1.0)


GROWING = {
    "name": "grows",
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 3,
    "steps": 1_000_000,
    "hyperparameters": {"hidden": 16, "layers": 2, "batch_size": 16},
}
"""A real job spec (a standby prepared for it builds it) that the fake worker runs until it is
stopped (a million steps of 20 ms): a test's job never ends under it, however slow the machine."""


def preparing(
    monkeypatch: pytest.MonkeyPatch, slots: int, prepared_per_job: int
) -> tuple[SimulatedBackend, WorkerSupervisor, StandbyPool]:
    """A supervisor on `slots` devices that prepares standbys for growing jobs, with fake workers
    that say "joined" after their first step (no standby is prepared while one here is joining)."""
    monkeypatch.setenv(JOINS_ENV, "1")
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0, standbys=8, prepared_per_job=prepared_per_job)
    )
    pool = supervisor._spawner.standbys
    assert pool is not None
    return SimulatedBackend(slots=slots), supervisor, pool


def test_a_standby_prepared_for_a_growing_job_serves_that_job_only(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, supervisor, pool = preparing(monkeypatch, slots=3, prepared_per_job=1)

    def settled(prepared_for: dict[int, int | None]) -> Callable[[], bool]:
        def check() -> bool:
            supervisor.keep_standbys(backend, set())
            standbys = pool.standbys()
            return (
                {s.device_index: s.job for s in standbys} == prepared_for
                and all(s.state in (StandbyState.WARM, StandbyState.PREPARED) for s in standbys)
            )

        return check

    try:
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=1, **GROWING), backend, REDIS_URL)  # job 1 on device 0
        # One standby a job here (prepared_per_job=1): the lowest free device's, where the
        # scheduler grows a job first; the other stays for any job.
        wait_until("device 1's standby prepared for job 1", settled({1: 1, 2: None}))
        [prepared] = [s for s in pool.standbys() if s.job == 1]
        assert PREPARED_LINE in prepared.output.read_text()
        # Job 1 grows onto device 1: the worker is the standby prepared for it.
        assert supervisor.launch(launch(generation=2, ranks=2, start=[1], **GROWING), backend, REDIS_URL)
        recorder.wait_for(lambda events: len(recorder.of("started")) == 2)
        assert recorder.of("started", generation=2)[0].pid == prepared.pid
        # Still below its most (2 of 3): device 2's standby is prepared for it next.
        wait_until("device 2's standby prepared for job 1", settled({2: 1}))
        # Another job asking for device 2 does not get job 1's modules: that standby is killed
        # and the worker starts cold.
        another_job_starts_cold_on_device_2(supervisor, backend, pool, recorder)
    finally:
        supervisor.shutdown(grace_s=1.0)


def another_job_starts_cold_on_device_2(
    supervisor: WorkerSupervisor, backend: SimulatedBackend, pool: StandbyPool, recorder: Recorder
) -> None:
    """Job 2's launch on device 2, whose only standby is job 1's: that standby is killed and job
    2's worker starts cold (the third worker started)."""
    [second] = pool.standbys()
    assert second.job == 1
    other = launch(job_id=2, ranks=3, start=[2], **{**GROWING, "name": "other"})
    assert supervisor.launch(other, backend, REDIS_URL)
    recorder.wait_for(lambda events: len(recorder.of("started")) == 3)
    [started] = [e for e in recorder.of("started") if e.job_id == 2]
    assert started.pid != second.pid
    wait_until("job 1's standby killed", lambda: gone(second.pid), 10)


def test_a_keep_between_a_launch_and_its_spawn_leaves_the_standby_to_the_spawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report loop keeps the standbys whenever the pool is free, and a launch lists its worker
    (the device busy, the job at its most) before its spawn takes the pool: a keep in between must
    not kill the standby the spawn is about to take (it did: the worker then started cold)."""
    backend, supervisor, pool = preparing(monkeypatch, slots=2, prepared_per_job=1)
    spec = {**GROWING, "max_workers": 2}
    try:
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=1, **spec), backend, REDIS_URL)

        def prepared() -> bool:
            supervisor.keep_standbys(backend, set())
            return [(s.device_index, s.job, s.state) for s in pool.standbys()] == [(1, 1, StandbyState.PREPARED)]

        wait_until("device 1's standby prepared for job 1", prepared)
        [standby] = pool.standbys()
        spawn = supervisor._spawner.spawn

        def keep_then_spawn(*args: Any) -> Any:
            assert supervisor.starting_devices() == {1}
            supervisor.keep_standbys(backend, set())  # the report loop, at the worst moment
            return spawn(*args)

        monkeypatch.setattr(supervisor._spawner, "spawn", keep_then_spawn)
        assert supervisor.launch(launch(generation=2, ranks=2, start=[1], **spec), backend, REDIS_URL)
        recorder.wait_for(lambda events: len(recorder.of("started")) == 2)
        assert recorder.of("started", generation=2)[0].pid == standby.pid
        assert supervisor.starting_devices() == set()
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_job_that_stops_growing_here_loses_its_prepared_standbys(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, supervisor, pool = preparing(monkeypatch, slots=2, prepared_per_job=2)
    try:
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=1, **GROWING), backend, REDIS_URL)

        def prepared() -> bool:
            supervisor.keep_standbys(backend, set())
            return [(s.job, s.state) for s in pool.standbys()] == [(1, StandbyState.PREPARED)]

        wait_until("a standby prepared for job 1", prepared)
        [standby] = pool.standbys()
        # Its last worker here ends: the standby holds a model nobody here will ask for.
        supervisor.stop(StopCommand(job_id=1, before_generation=2, reason="cancel"))
        recorder.wait_for(recorder.exits(1))
        supervisor.keep_standbys(backend, set())
        assert standby.pid not in supervisor.standby_pids()
        wait_until("the prepared standby killed", lambda: gone(standby.pid), 10)
    finally:
        supervisor.shutdown(grace_s=1.0)


def test_a_preparation_past_its_deadline_is_killed_and_its_job_not_prepared_again(
    tmp_path: os.PathLike[str], backend: SimulatedBackend
) -> None:
    import sys

    from agent.standby import PREPARE_TIMEOUT_S

    pool = StandbyPool(tmp_path, sys.executable, FAKE_WORKER, limit=1, prepared_per_job=1)  # type: ignore[arg-type]
    free = {0: backend.placement(0)}
    try:
        pool.keep(free, dict(os.environ))
        [standby] = pool.standbys()
        wait_until("the standby to warm up", warmed(pool, standby))
        # As if it had been sent a preparation that never finished (a job's code that hangs).
        standby.job = 1
        pool._move(standby, StandbyState.PREPARING)
        standby.since -= PREPARE_TIMEOUT_S + 1
        calls: list[int] = []

        def prepare_env(job: int, index: int, placement: object) -> dict[str, str]:
            calls.append(job)
            return dict(os.environ)

        pool.keep(free, dict(os.environ), [1], prepare_env)
        assert standby not in pool.standbys() and calls == []
        wait_until("the stuck standby killed", lambda: gone(standby.pid), 10)
        # The device gets a new standby (started in the same call), never prepared for that job.
        [fresh] = pool.standbys()
        wait_until("the new standby to warm up", warmed(pool, fresh))
        pool.keep(free, dict(os.environ), [1], prepare_env)
        assert calls == [] and fresh.job is None
    finally:
        pool.close()


def test_the_standby_pids_are_told_while_a_spawn_holds_the_pool(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    """Each report asks for the standby pids, and a spawn holds the pool for as long as its take or
    fork lasts (long, under load): the answer does not wait for the spawn, and is the pool's."""
    spawner = WorkerSpawner(
        SupervisorConfig(worker_module=FAKE_WORKER, standbys=1), RecordStore(tmp_path / "workers"), tmp_path
    )
    try:
        spawner.keep_standbys(lambda: {0: backend.placement(0)}, lambda: [], lambda *_: {}, lambda: False, set)
        [(pid, index)] = spawner.standby_pids().items()
        assert index == 0
        told: list[dict[int, int]] = []
        reader = threading.Thread(target=lambda: told.append(spawner.standby_pids()))
        with spawner._pool_lock:  # as a spawn in flight holds it
            reader.start()
            reader.join(timeout=30)
            answered = not reader.is_alive()
        reader.join(timeout=30)
        assert answered, "standby_pids waited for the pool"
        assert told == [{pid: 0}]
        spawner.close_standbys()
        assert spawner.standby_pids() == {}
        wait_until("the standby to die", lambda: gone(pid), 10)
    finally:
        spawner.close_standbys()


def test_a_job_in_its_own_environment_grows_onto_a_standby_prepared_in_that_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A job with packages of its own: once its environment is built here, its standbys start from
    the environment's interpreter (its model is built where its worker runs), are prepared, and
    serve its grow (same pid); the environment is in use while they wait, and a standby of it
    serves no worker of the node's environment."""
    from tests.environment_support import TINY, tiny_wheelhouse
    from tests.test_agent_environments import declared, environments

    cache = environments(tmp_path / "environments", tiny_wheelhouse(tmp_path / "wheelhouse"), max_bytes=0)
    environment = cache.ensure(declared(f"{TINY}==1.0\n"))
    python = str(environment.python)
    backend, supervisor, pool = preparing(monkeypatch, slots=3, prepared_per_job=1)
    cache.count_in_use(supervisor.standby_interpreters)
    try:
        recorder = Recorder(supervisor)
        assert supervisor.launch(launch(ranks=1, **GROWING), backend, REDIS_URL, python=python)

        def standbys_are(*expected: tuple[int, int | None, str | None, StandbyState]) -> Callable[[], bool]:
            def check() -> bool:
                supervisor.keep_standbys(backend, set())
                return {(s.device_index, s.job, s.python, s.state) for s in pool.standbys()} == set(expected)

            return check

        wait_until("device 1's standby started and prepared in job 1's environment", standbys_are(
            (1, 1, python, StandbyState.PREPARED), (2, None, None, StandbyState.WARM)
        ))
        [own] = [s for s in pool.standbys() if s.job == 1]
        assert psutil.Process(own.pid).cmdline()[0] == python
        assert PREPARED_LINE in own.output.read_text()
        # The cache is over its cap (0 bytes): the environment stays, a standby runs from it.
        assert environment.digest in cache.in_use() and cache.evict() == [] and environment.path.is_dir()
        assert supervisor.launch(launch(generation=2, ranks=2, start=[1], **GROWING), backend, REDIS_URL, python=python)
        recorder.wait_for(lambda events: len(recorder.of("started")) == 2)
        assert recorder.of("started", generation=2)[0].pid == own.pid
        # Job 1 grows on (2 of 3): device 2's node standby gives way to one in its environment.
        wait_until("device 2's standby prepared in job 1's environment", standbys_are(
            (2, 1, python, StandbyState.PREPARED)
        ))
        # A job of the node's environment on device 2 does not get it: killed, the worker cold.
        another_job_starts_cold_on_device_2(supervisor, backend, pool, recorder)
    finally:
        supervisor.shutdown(grace_s=1.0)
