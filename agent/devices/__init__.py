"""Device backends by name: "nvml" (NVIDIA GPUs), "simulated" (CPU cores as slots) and "auto"
(nvml where it finds a GPU, else simulated). `make_backend` is the one way the agent gets one.
"""

from __future__ import annotations

import logging

from agent.devices.api import (
    BackendRegistry,
    BackendUnavailableError,
    DeviceBackend,
    DeviceError,
    GpuSelection,
    NotSupportedError,
    UnknownBackendError,
    UnknownDeviceError,
    WorkerPids,
    WorkerPlacement,
)

log = logging.getLogger(__name__)

__all__ = [
    "BackendUnavailableError",
    "DeviceBackend",
    "DeviceError",
    "GpuSelection",
    "NotSupportedError",
    "UnknownBackendError",
    "UnknownDeviceError",
    "WorkerPids",
    "WorkerPlacement",
    "backend_names",
    "make_backend",
    "registry",
]


def _nvml(*, slots: int | None = None, node_name: str | None = None, pace: float = 1.0,
          gpus: GpuSelection | None = None) -> DeviceBackend:
    from agent.devices.nvml import NvmlBackend

    if pace != 1.0:
        raise DeviceError(f"a pace (got {pace!r}) is for simulated slots; a GPU keeps its own")

    return NvmlBackend(slots=slots, node_name=node_name, gpus=gpus)


def _simulated(*, slots: int | None = None, node_name: str | None = None, pace: float = 1.0,
               gpus: GpuSelection | None = None) -> DeviceBackend:
    from agent.devices.simulated import SimulatedBackend

    if gpus is not None:
        raise DeviceError(f"a GPU selection ({gpus}) is for nvml; simulated slots are CPU cores")
    return SimulatedBackend(slots=slots, node_name=node_name, pace=pace)


def _auto(*, slots: int | None = None, node_name: str | None = None, pace: float = 1.0,
          gpus: GpuSelection | None = None) -> DeviceBackend:
    try:
        backend = registry.create("nvml", node_name=node_name, gpus=gpus)
    except BackendUnavailableError as err:
        if gpus is not None:
            raise  # GPUs were named: slots in their place would be a different node
        log.info("no GPU through NVML (%s): simulating CPU slots", err)
        return registry.create("simulated", slots=slots, node_name=node_name, pace=pace)
    if slots is not None:
        log.warning("found GPUs through NVML: ignoring slots=%d, which is for simulated slots", slots)
    if pace != 1.0:
        log.warning("found GPUs through NVML: ignoring pace=%g, which is for simulated slots", pace)
    return backend


registry = BackendRegistry()
registry.register("nvml", _nvml)
registry.register("simulated", _simulated)
registry.register("auto", _auto)


def make_backend(name: str, **options: object) -> DeviceBackend:
    """Returns a new backend; options: `slots` (simulated slots, default one per CPU),
    `node_name` (seeds simulated UUIDs), `pace` (simulated slots' step stretch, default 1) and
    `gpus` (nvml: only these GPUs of the machine, a GpuSelection; default all).
    Raises UnknownBackendError for an unknown name, BackendUnavailableError where the machine
    lacks the devices, DeviceError for bad options."""
    return registry.create(name, **options)


def backend_names() -> list[str]:
    return registry.names()
