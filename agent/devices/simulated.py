"""CPU cores posing as devices, so that the whole platform runs and is tested on a laptop.

Slot i is the i-th core this process may run on; a worker placed on it is pinned to that core
and told to use device "cpu". What a slot reports is measured, not invented, except where a
CPU has nothing to measure:

- utilisation: the CPU percent of the agent's workers on the slot, their children included,
  since the previous sample (capped at 100: one slot is one core);
- memory used: their resident set size; memory total: an equal share of the machine's RAM;
- temperature and power: SIMULATED from utilisation by a linear model, an idle slot at
  35 °C and 10 W rising to 80 °C and 100 W at full load;
- owner: a test or a demo plays a device's owner coming back with `set_owner_present`; the
  slot then lists a process named "owner" (pid 0) that the agent did not start;
- speed: `set_slowdown` plays a slow device (a throttled or weaker card): a worker started on
  it gets SLOWDOWN_ENV and stretches each step's compute by that factor;
- pace: every slot's steps can be stretched alike (`pace`, the agent's --sim-pace): a worker
  started on a slot gets PACE_ENV and, after each step, sleeps (pace - 1) times the CPU time the
  step took, as a GPU's step leaves its host's CPU mostly idle, so that several simulated nodes
  share a laptop's few cores without each worker running flat out: a paced worker keeps at most
  1/pace of a core busy, whatever part of its step (compute, all-reduce, bookkeeping) costs the
  CPU. A played slowdown stretches the compute on top of that, in the paced device's time
  (slowdown x pace times the compute).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import psutil

from agent.devices.api import (
    DeviceBackend,
    DeviceError,
    UnknownDeviceError,
    WorkerPids,
    WorkerPlacement,
)
from elastic.wire import DeviceInfo, DeviceProcess, DeviceSample

IDLE_TEMPERATURE_C = 35.0
TEMPERATURE_C_PER_PCT = 0.45
IDLE_POWER_W = 10.0
POWER_W_PER_PCT = 0.9

SLOWDOWN_ENV = "BUNGEE_SIM_SLOWDOWN"
"""Read by the worker (elastic.worker.settings); the same name on both sides."""
PACE_ENV = "BUNGEE_SIM_STEP_PACE"
"""Read by the worker (elastic.worker.settings); the same name on both sides. Not the agent's
BUNGEE_SIM_PACE, which the agent's workers inherit wherever it is set."""
MAX_PACE = 100.0
"""The largest pace: a step stretched further teaches nothing a slower test could not."""
OWNER_PROCESS = DeviceProcess(pid=0, name="owner", memory_bytes=0, ours=False)


def simulated_temperature_c(utilization_pct: float) -> float:
    """Returns the simulated temperature of a slot at `utilization_pct` (linear model)."""
    return IDLE_TEMPERATURE_C + TEMPERATURE_C_PER_PCT * utilization_pct


def simulated_power_w(utilization_pct: float) -> float:
    """Returns the simulated power draw of a slot at `utilization_pct` (linear model)."""
    return IDLE_POWER_W + POWER_W_PER_PCT * utilization_pct


class SimulatedBackend(DeviceBackend):
    """`slots` CPU slots (default: the number of CPUs). `node_name` seeds the slots' UUIDs, so
    that a node keeps its UUIDs across agent restarts and two nodes on one machine differ.
    `pace` (1 to MAX_PACE) stretches every slot's steps by that factor (in CPU: a worker keeps at
    most 1/pace of a core busy)."""

    name = "simulated"

    def __init__(self, slots: int | None = None, node_name: str | None = None, pace: float = 1.0) -> None:
        count = (os.cpu_count() or 1) if slots is None else slots
        if count < 1:
            raise DeviceError(f"a simulated node needs at least one slot, got slots={slots!r}")
        if not 1.0 <= pace <= MAX_PACE:
            raise DeviceError(f"a simulated node's pace is from 1 to {MAX_PACE:g}, got {pace!r}")
        self._pace = pace
        self._count = count
        self._memory_total = psutil.virtual_memory().total // count
        seed = node_name or socket.gethostname()
        self._devices = [
            DeviceInfo(
                index=index,
                uuid=f"SIM-{uuid.uuid5(uuid.NAMESPACE_URL, f'bungee-sim:{seed}:{index}')}",
                name=f"Simulated CPU slot {index}",
                kind="cpu-slot",
                memory_total_bytes=self._memory_total,
            )
            for index in range(count)
        ]
        self._cores = sorted(os.sched_getaffinity(0))
        self._owners: set[int] = set()
        self._slowdown: dict[int, float] = {}
        # psutil measures CPU percent between two calls on the same Process object, so the
        # objects live from one sample to the next.
        self._tracked: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def placement(self, index: int) -> WorkerPlacement:
        self._check(index)
        affinity = frozenset({self._cores[index]}) if index < len(self._cores) else None
        with self._lock:
            slowdown = self._slowdown.get(index, 1.0)
        env = {PACE_ENV: repr(self._pace)} if self._pace > 1.0 else {}
        if slowdown > 1.0:
            env[SLOWDOWN_ENV] = repr(slowdown)
        return WorkerPlacement(device="cpu", env=env, cpu_affinity=affinity)

    def set_slowdown(self, index: int, factor: float) -> None:
        self._check(index)
        if not factor >= 1.0:
            raise DeviceError(f"a slowdown factor is at least 1, got {factor!r}")
        with self._lock:
            self._slowdown[index] = factor

    def set_owner_present(self, index: int, present: bool) -> None:
        self._check(index)
        with self._lock:
            if present:
                self._owners.add(index)
            else:
                self._owners.discard(index)

    def sample(self, workers: WorkerPids) -> list[DeviceSample]:
        taken_at = time.time()
        busy = [0.0] * self._count
        memory = [0] * self._count
        processes: list[list[DeviceProcess]] = [[] for _ in range(self._count)]
        with self._lock:
            seen: dict[int, psutil.Process] = {}
            for pid, (job_id, index) in sorted(workers.items()):
                if not 0 <= index < self._count:
                    continue
                measured = self._measure(pid, seen)
                if measured is None:
                    continue
                name, cpu_pct, rss = measured
                busy[index] += cpu_pct
                memory[index] += rss
                processes[index].append(
                    DeviceProcess(
                        pid=pid, name=name, memory_bytes=rss, utilization_pct=min(100.0, cpu_pct),
                        ours=True, job_id=job_id,
                    )
                )
            self._tracked = seen
            owners = set(self._owners)
        samples = []
        for index in range(self._count):
            utilization = min(100.0, busy[index])
            owner = index in owners
            samples.append(
                DeviceSample(
                    index=index,
                    taken_at=taken_at,
                    utilization_pct=utilization,
                    memory_used_bytes=memory[index],
                    memory_total_bytes=self._memory_total,
                    temperature_c=simulated_temperature_c(utilization),
                    power_w=simulated_power_w(utilization),
                    processes=processes[index] + ([OWNER_PROCESS] if owner else []),
                    owner_present=owner,
                )
            )
        return samples

    def _measure(self, pid: int, seen: dict[int, psutil.Process]) -> tuple[str, float, int] | None:
        """Returns (name, CPU percent, RSS) of `pid` and its descendants, or None if `pid` is
        gone. Records every process measured in `seen`."""
        root = self._process(pid, seen)
        if root is None:
            return None
        try:
            name = root.name()
            tree = [root] + [
                child
                for found in root.children(recursive=True)
                if (child := self._process(found.pid, seen)) is not None
            ]
        except psutil.Error:
            return None
        cpu_pct = 0.0
        rss = 0
        for process in tree:
            try:
                with process.oneshot():
                    cpu_pct += process.cpu_percent(interval=None)
                    rss += process.memory_info().rss
            except psutil.Error:
                continue
        return name, cpu_pct, rss

    def _process(self, pid: int, seen: dict[int, psutil.Process]) -> psutil.Process | None:
        process = seen.get(pid) or self._tracked.get(pid)
        # is_running() also notices a pid reused by a new process since the last sample.
        if process is None or not process.is_running():
            try:
                process = psutil.Process(pid)
            except psutil.Error:
                return None
        seen[pid] = process
        return process

    def _check(self, index: int) -> None:
        if not 0 <= index < self._count:
            raise UnknownDeviceError(
                f"device index {index} is not on this node (simulated slots 0..{self._count - 1})"
            )
