"""Which warm standbys this node keeps (agent.standby), decided from what its supervisor knows: one
on each free device (no worker of ours runs there, its owner is not there), none once the
supervisor is shut down, and, while no resize is under way here, some prepared for each job that
may grow (its newest generation here has fewer workers than its most); a job that runs an
environment of its own gets its standbys started in that environment. The keeper reads the supervisor's ledger through
NodeWorkers, a narrow read-only view, and hands its decisions to the spawner, which owns the pool
(agent.spawn); it asks the view only once the pool is free, so that a worker listed meanwhile
keeps its device.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from agent.devices import DeviceBackend, DeviceError, WorkerPlacement
from agent.spawn import Launch, WorkerSpawner
from elastic.wire import WorkerAssignment

log = logging.getLogger(__name__)

RESIZE_QUIET_S = 2.0
"""Standbys are prepared only this long after a worker here joined a generation (and never while
one has not yet): the resize's transfer and first step have the node's memory to themselves."""


class NodeWorkers(Protocol):
    """What the keeper reads of the supervisor's ledger (each call a consistent snapshot)."""

    def closed(self) -> bool:
        """Whether the supervisor is shut down."""
        ...

    def busy_devices(self) -> set[int]:
        """The devices where a worker of ours runs or is being started."""
        ...

    def starting_devices(self) -> set[int]:
        """The devices where a worker of ours is being started (listed, not yet spawned)."""
        ...

    def newest_launches(self) -> dict[int, Launch]:
        """By job id, in id order: the newest launch here of each job with a worker here."""
        ...

    def settled_since(self) -> float | None:
        """When a worker here last said "joined" (time.monotonic; -inf if none ever did), or None
        while one here has not joined its generation yet."""
        ...


class StandbyKeeper:
    """Keeps the standbys of `spawner`'s pool as `workers` call for. Thread-safe."""

    def __init__(self, spawner: WorkerSpawner, workers: NodeWorkers) -> None:
        self._spawner = spawner
        self._workers = workers

    def keep(self, backend: DeviceBackend, taken: set[int]) -> None:
        """Keeps a warm standby on each device of `backend` that runs no worker of ours and is
        not in `taken` (its owner is there), and none on any other. Does nothing unless
        standbys are on."""
        if self._workers.closed():
            self._spawner.close_standbys()
            return
        # A shutdown after this check is harmless: its close_standbys and the keep below hold the
        # spawner's pool lock, and a keep after the close starts nothing.

        # The jobs growing when the pool asked, with the launch their prepared standbys follow.
        launches: dict[int, Launch] = {}

        def placements() -> dict[int, WorkerPlacement]:
            busy = self._workers.busy_devices()
            placements = {}
            for device in backend.devices():
                if device.index not in busy | taken:
                    try:
                        placements[device.index] = backend.placement(device.index)
                    except DeviceError as err:
                        log.warning("no standby on device %d: %s", device.index, err)
            return placements

        def jobs_growing() -> list[int]:
            launches.update(self.growing())
            return list(launches)

        def prepared_env(job_id: int, device_index: int, placement: WorkerPlacement) -> dict[str, str]:
            return self._prepared_env(launches[job_id], device_index, placement)

        def pythons() -> dict[int, str]:
            return {job_id: launch.python for job_id, launch in launches.items() if launch.python is not None}

        self._spawner.keep_standbys(
            placements, jobs_growing, prepared_env, self.quiet, self._workers.starting_devices, pythons
        )

    def quiet(self) -> bool:
        """Whether no resize is under way on this node: every worker here has joined its
        generation, the last of them at least RESIZE_QUIET_S ago (its first step is done)."""
        since = self._workers.settled_since()
        return since is not None and time.monotonic() - since >= RESIZE_QUIET_S

    def growing(self) -> dict[int, Launch]:
        """The jobs a standby may be prepared for, with their newest launch here."""
        return {
            job_id: launch
            for job_id, launch in self._workers.newest_launches().items()
            if launch.command.world_size < int(launch.command.spec.get("max_workers", 0))
        }

    def _prepared_env(self, launch: Launch, device_index: int, placement: WorkerPlacement) -> dict[str, str]:
        """The environment of the worker `launch`'s job would start on `device_index` if it grew
        by one: one rank more (provisional: a worker takes its rank and generation when it
        enters one)."""
        command = launch.command
        config = self._spawner.worker_config(
            launch,
            WorkerAssignment(rank=command.world_size, device_index=device_index),
            placement,
            generation=command.generation + 1,
            world_size=command.world_size + 1,
        )
        return self._spawner.env_of(config, placement, launch.python)
