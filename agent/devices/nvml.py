"""NVIDIA GPUs through NVML (the `pynvml` module of the `nvidia-ml-py` distribution).

A GPU's reading is NVML's own: utilisation, memory, temperature, power (NVML gives milliwatts)
and the compute and graphics processes holding memory on it. A process on a GPU that is not
one of the agent's workers, nor a child of one, is the owner's: the device reports
`owner_present`. Fields the GPU does not support are reported as None (utilisation as 0).

PIDs are compared as this process sees them: an agent in a container must share the host's
PID namespace (`pid: host`), or every GPU process looks foreign and every GPU owned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil
import pynvml

from agent.devices.api import (
    BackendUnavailableError,
    DeviceBackend,
    DeviceError,
    GpuSelection,
    NotSupportedError,
    UnknownDeviceError,
    WorkerPids,
    WorkerPlacement,
)
from elastic.wire import DeviceInfo, DeviceProcess, DeviceSample

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class GpuProcess:
    """A process as NVML lists it on one GPU; `memory_bytes` is None where NVML cannot say."""

    pid: int
    memory_bytes: int | None
    utilization_pct: float | None = None


def classify_processes(
    found: Iterable[GpuProcess],
    ours: Mapping[int, int | None],
    name_of: Callable[[int], str],
) -> tuple[list[DeviceProcess], bool]:
    """Returns the GPU's processes, each marked ours or not, and whether the owner is present.

    `found` may list a pid twice (a process with a compute and a graphics context); it is
    reported once, with the larger memory. `ours` maps the pids of the agent's workers and of
    their descendants to their job id. The owner is present when any process is not ours.
    """
    memory: dict[int, int] = {}
    utilization: dict[int, float] = {}
    for process in found:
        memory[process.pid] = max(memory.get(process.pid, 0), process.memory_bytes or 0)
        if process.utilization_pct is not None:
            utilization[process.pid] = max(utilization.get(process.pid, 0.0), process.utilization_pct)
    processes = [
        DeviceProcess(
            pid=pid,
            name=name_of(pid),
            memory_bytes=used,
            utilization_pct=utilization.get(pid),
            ours=pid in ours,
            job_id=ours.get(pid),
        )
        for pid, used in sorted(memory.items())
    ]
    return processes, any(not process.ours for process in processes)


def with_descendants(workers: WorkerPids) -> dict[int, int | None]:
    """Returns pid -> job_id (None for a standby) for the workers and every live descendant of theirs."""
    ours = {pid: job_id for pid, (job_id, _) in workers.items()}
    for pid, (job_id, _) in workers.items():
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        ours.update((child.pid, job_id) for child in children)
    return ours


def process_name(pid: int) -> str:
    """Returns the process's name as the OS knows it, else as NVML does, else "pid N"."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        pass
    try:
        return _text(pynvml.nvmlSystemGetProcessName(pid))
    except pynvml.NVMLError:
        return f"pid {pid}"


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _optional(read: Callable[[], T]) -> T | None:
    """Returns read(), or None where the GPU does not support that reading."""
    try:
        return read()
    except pynvml.NVMLError as err:
        if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def selected_gpus(found: list[tuple[int | None, str]], gpus: GpuSelection) -> list[int]:
    """The positions in `found` (each GPU's minor number, None where NVML has none, and UUID, in
    NVML's order) of the GPUs `gpus` names, in NVML's order. Raises BackendUnavailableError,
    quoting both, if one it names is not among them."""
    chosen = [i for i, (minor, uuid) in enumerate(found) if minor in gpus.minors or uuid in gpus.uuids]
    missing = (gpus.minors - {found[i][0] for i in chosen}) | (gpus.uuids - {found[i][1] for i in chosen})
    if missing or not chosen:
        seen = ", ".join(f"minor {minor} ({uuid})" for minor, uuid in found) or "none"
        raise BackendUnavailableError(f"NVML does not see every GPU asked for ({gpus}); it sees {seen}")
    return chosen


def _minor(handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError:  # not on every platform
        return None


class NvmlBackend(DeviceBackend):
    """Every GPU NVML sees, or with `gpus` only those (a Slurm allocation's), numbered from 0 in
    NVML's order; a worker on one of those is given it by UUID, which CUDA understands whatever
    devices a cgroup lets it see. Raises BackendUnavailableError if NVML does not initialise,
    finds no GPU or not every GPU of `gpus`, DeviceError if given `slots` (a simulated backend's
    option). `node_name` is accepted for symmetry with the simulated backend and unused: GPUs
    carry their own UUIDs."""

    name = "nvml"

    def __init__(self, *, slots: int | None = None, node_name: str | None = None,
                 gpus: GpuSelection | None = None) -> None:
        if slots is not None:
            raise DeviceError(f"slots={slots!r} applies to the simulated backend, not to nvml")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise BackendUnavailableError(f"NVML did not initialise: {err}") from err
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count < 1:
                raise BackendUnavailableError("NVML initialised but found no GPU")
            if gpus is None:
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            else:
                handles = []
                for i in range(count):
                    try:
                        handles.append(pynvml.nvmlDeviceGetHandleByIndex(i))
                    except pynvml.NVMLError as err:  # a GPU a cgroup keeps from us is not ours
                        log.info("GPU %d is not open to this agent (%s): not one of its GPUs", i, err)
                found = [(_minor(h), _text(pynvml.nvmlDeviceGetUUID(h))) for h in handles]
                self._handles = [handles[i] for i in selected_gpus(found, gpus)]
            self._by_uuid = gpus is not None
            self._last_sample_us: dict[int, int] = {}
            self._devices = [
                DeviceInfo(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    kind="gpu",
                    memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
                for index, handle in enumerate(self._handles)
            ]
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._lock = threading.Lock()

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def placement(self, index: int) -> WorkerPlacement:
        self._check(index)
        if self._by_uuid:
            return WorkerPlacement(device="cuda:0", env={"CUDA_VISIBLE_DEVICES": self._devices[index].uuid})
        # NVML numbers GPUs in PCI bus order; CUDA, unless told so, fastest first.
        return WorkerPlacement(
            device="cuda:0",
            env={"CUDA_VISIBLE_DEVICES": str(index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        )

    def set_owner_present(self, index: int, present: bool) -> None:
        self._check(index)
        raise NotSupportedError(
            f"device {index} is a real GPU: its owner comes back by starting a process on it, "
            "it cannot be played (use the simulated backend)"
        )

    def sample(self, workers: WorkerPids) -> list[DeviceSample]:
        ours = with_descendants(workers)
        samples = []
        with self._lock:
            for index, handle in enumerate(self._handles):
                try:
                    samples.append(self._sample_one(index, handle, ours))
                except pynvml.NVMLError as err:
                    log.warning("could not read GPU %d (%s): %s", index, self._devices[index].uuid, err)
        if not samples:
            raise DeviceError("NVML could not read any GPU")
        return samples

    def close(self) -> None:
        pynvml.nvmlShutdown()

    def _sample_one(self, index: int, handle: Any, ours: Mapping[int, int | None]) -> DeviceSample:
        taken_at = time.time()
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        rates = _optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
        temperature = _optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        power_mw = _optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle))
        # Per-process SM utilisation since the previous sample of this GPU (NVML keeps a short
        # ring of samples; asking from the last timestamp reads only the new ones).
        since_us = self._last_sample_us.get(index, 0)
        self._last_sample_us[index] = int(taken_at * 1e6)
        sm_util: dict[int, float] = {}
        for reading in _optional(lambda: pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)) or []:
            sm_util[int(reading.pid)] = max(sm_util.get(int(reading.pid), 0.0), float(reading.smUtil))
        found = [
            GpuProcess(pid=int(p.pid), memory_bytes=p.usedGpuMemory, utilization_pct=sm_util.get(int(p.pid)))
            for p in [
                *(_optional(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []),
                *(_optional(lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)) or []),
            ]
        ]
        processes, owner_present = classify_processes(found, ours, process_name)
        return DeviceSample(
            index=index,
            taken_at=taken_at,
            utilization_pct=float(rates.gpu) if rates is not None else 0.0,
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            processes=processes,
            owner_present=owner_present,
        )

    def _check(self, index: int) -> None:
        if not 0 <= index < len(self._devices):
            raise UnknownDeviceError(
                f"device index {index} is not on this node (GPUs 0..{len(self._devices) - 1})"
            )
