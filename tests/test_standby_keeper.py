"""The standby keeper's decisions (agent.standby_keeper), from what the supervisor's ledger says
through NodeWorkers: which jobs a standby may be prepared for, whether the node is quiet enough to
prepare one, and no standby started by a keep that a shutdown overtook; and the supervisor's side
of that view, with a real (fake) worker."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.devices.simulated import SimulatedBackend
from agent.records import RecordStore
from agent.settings import SupervisorConfig
from agent.spawn import Launch, WorkerSpawner
from agent.standby_keeper import RESIZE_QUIET_S, StandbyKeeper
from agent.supervisor import WorkerSupervisor
from tests.agent_fake_worker import JOINS_ENV
from tests.test_agent_supervisor import FAKE_WORKER, REDIS_URL, Recorder, launch


@dataclass
class Ledger:
    """What a supervisor's ledger says, as NodeWorkers gives it."""

    launches: dict[int, Launch] = field(default_factory=dict)
    since: float | None = -math.inf
    shut: bool = False

    def closed(self) -> bool:
        return self.shut

    def busy_devices(self) -> set[int]:
        return set()

    def starting_devices(self) -> set[int]:
        return set()

    def newest_launches(self) -> dict[int, Launch]:
        return self.launches

    def settled_since(self) -> float | None:
        return self.since


@dataclass
class ShutDownAfterTheCheck(Ledger):
    """A supervisor that says it is not shut down, and shuts down (closes the spawner's standbys,
    as WorkerSupervisor.shutdown does) before the keeper that asked goes on."""

    spawner: WorkerSpawner | None = None

    def closed(self) -> bool:
        assert self.spawner is not None
        self.spawner.close_standbys()
        return False


def keeper(tmp_path: Path, ledger: Ledger) -> StandbyKeeper:
    spawner = WorkerSpawner(SupervisorConfig(), RecordStore(tmp_path / "workers"), tmp_path)
    return StandbyKeeper(spawner, ledger)


def a_launch(job_id: int, ranks: int, max_workers: int, python: str | None = None) -> Launch:
    command = launch(job_id=job_id, ranks=ranks, max_workers=max_workers)
    return Launch(command, SimulatedBackend(slots=4), REDIS_URL, None, None, python)


def test_only_jobs_below_their_most_workers_grow_in_the_nodes_environment_or_their_own(tmp_path: Path) -> None:
    below, full, own_environment, later = (
        a_launch(1, ranks=1, max_workers=3),
        a_launch(2, ranks=3, max_workers=3),
        a_launch(3, ranks=1, max_workers=3, python="/envs/job3/bin/python"),
        a_launch(4, ranks=2, max_workers=4),
    )
    ledger = Ledger(launches={1: below, 2: full, 3: own_environment, 4: later})
    assert keeper(tmp_path, ledger).growing() == {1: below, 3: own_environment, 4: later}


@pytest.mark.parametrize(
    ("joined_ago_s", "quiet"),
    [
        (None, False),  # a worker here has not joined its generation yet
        (0.0, False),  # one just joined: its transfer and first step have the node
        (RESIZE_QUIET_S + 1.0, True),
        (math.inf, True),  # none ever joined
    ],
)
def test_the_node_is_quiet_only_once_every_worker_joined_a_while_ago(
    tmp_path: Path, joined_ago_s: float | None, quiet: bool
) -> None:
    since = None if joined_ago_s is None else time.monotonic() - joined_ago_s
    assert keeper(tmp_path, Ledger(since=since)).quiet() is quiet


def test_a_keep_overtaken_by_a_shutdown_starts_no_standby(tmp_path: Path) -> None:
    """A standby started after the shutdown closed the pool would be an orphan: nothing kills it."""
    spawner = WorkerSpawner(
        SupervisorConfig(worker_module=FAKE_WORKER, standbys=1), RecordStore(tmp_path / "workers"), tmp_path
    )
    ledger = ShutDownAfterTheCheck(spawner=spawner)
    try:
        StandbyKeeper(spawner, ledger).keep(SimulatedBackend(slots=1), set())
        assert spawner.standby_pids() == {}
        assert spawner.standbys is not None and spawner.standbys.standbys() == []
    finally:
        assert spawner.standbys is not None
        spawner.standbys.close()  # what the old keep started, if anything


def test_the_supervisor_shows_its_workers_devices_launches_and_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOINS_ENV, "1")  # the fake worker says "joined" after its first step
    backend = SimulatedBackend(slots=2)
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=5.0))
    try:
        assert supervisor.settled_since() == -math.inf and supervisor.newest_launches() == {}
        command = launch(ranks=1, steps=1000, max_workers=2)
        recorder = Recorder(supervisor)
        assert supervisor.launch(command, backend, REDIS_URL)
        assert supervisor.busy_devices() == {0} and supervisor.starting_devices() == set()  # spawned
        assert [launch.command for launch in supervisor.newest_launches().values()] == [command]
        recorder.wait_for(lambda events: bool(recorder.of("joined")))
        since = supervisor.settled_since()
        assert since is not None and since > -math.inf
        assert not supervisor.closed()
    finally:
        supervisor.shutdown(grace_s=1.0)
    assert supervisor.closed() and supervisor.busy_devices() == set()
