"""The device backend interface: what a node's accelerators are, how busy they are, who is on
them, and how a worker is placed on one of them.

A backend is picked by name through `agent.devices.make_backend`; the implementations live
beside this file (`nvml.py` for NVIDIA GPUs, `simulated.py` for CPU cores posing as devices).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.wire import DeviceInfo, DeviceSample

WorkerPids = Mapping[int, tuple[int | None, int]]
"""The agent's live workers: pid -> (job_id, device_index)."""


class DeviceError(Exception):
    """Base of every error a device backend raises."""


class BackendUnavailableError(DeviceError):
    """The backend cannot run on this machine (no driver, no device)."""


class UnknownBackendError(DeviceError):
    """No backend is registered under the name asked for."""


class UnknownDeviceError(DeviceError):
    """A device index that this node does not have."""


class NotSupportedError(DeviceError):
    """The backend cannot do what was asked (e.g. play a device's owner on real hardware)."""


@dataclass(frozen=True)
class GpuSelection:
    """The GPUs of this machine that are the node's, where it holds only some (a Slurm
    allocation): by device minor number (/dev/nvidia<minor>; Slurm's GPU ids on the usual
    gres.conf) or by UUID (a CUDA_VISIBLE_DEVICES of UUIDs)."""

    minors: frozenset[int] = frozenset()
    uuids: frozenset[str] = frozenset()

    def __str__(self) -> str:
        named = [f"minor {m}" for m in sorted(self.minors)] + sorted(self.uuids)
        return ", ".join(named) or "no GPU"


@dataclass(frozen=True)
class WorkerPlacement:
    """How to start a worker on one device: the torch device string it is told to use, extra
    environment variables, and the CPU cores to pin it to (None: leave the affinity alone)."""

    device: str
    env: Mapping[str, str] = field(default_factory=dict)
    cpu_affinity: frozenset[int] | None = None


class DeviceBackend(abc.ABC):
    """The devices of one node. Implementations are safe to call from several threads."""

    name: str
    """The registry name the backend is reported under (NodeRegistration.backend)."""

    @abc.abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Returns the node's devices, ordered by index; the list does not change while the
        backend lives."""

    @abc.abstractmethod
    def sample(self, workers: WorkerPids) -> list[DeviceSample]:
        """Returns one fresh reading per device. `workers` maps the pids of the agent's workers
        to (job_id, device_index), a standby's job_id being None; a process on a device that is not one of them (nor one of
        their children) marks the device `owner_present`. Raises DeviceError if the devices
        cannot be read at all."""

    @abc.abstractmethod
    def placement(self, index: int) -> WorkerPlacement:
        """Returns how to start a worker on device `index`; raises UnknownDeviceError for an
        index the node does not have."""

    @abc.abstractmethod
    def set_owner_present(self, index: int, present: bool) -> None:
        """Plays the owner of device `index` arriving or leaving. Raises NotSupportedError on
        real hardware, UnknownDeviceError for an index the node does not have."""

    def set_slowdown(self, index: int, factor: float) -> None:
        """Plays device `index` being `factor` times slower than normal for the workers started
        on it from now on. Raises NotSupportedError on real hardware, UnknownDeviceError for an
        index the node does not have."""
        raise NotSupportedError(f"the {self.name} backend cannot play a slow device")

    def close(self) -> None:
        """Releases what the backend holds (driver handles); the default holds nothing."""
        return None


BackendFactory = Callable[..., DeviceBackend]


class BackendRegistry:
    """Names to backend factories. A factory takes the backend's options as keywords and
    raises DeviceError (BackendUnavailableError where the machine lacks what it needs)."""

    def __init__(self) -> None:
        self._factories: dict[str, BackendFactory] = {}

    def register(self, name: str, factory: BackendFactory) -> None:
        """Adds `factory` under `name`; raises ValueError if the name is taken."""
        if name in self._factories:
            raise ValueError(f"a device backend named {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, **options: Any) -> DeviceBackend:
        """Returns a new backend; raises UnknownBackendError for a name not registered, and
        whatever the factory raises."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise UnknownBackendError(
                f"unknown device backend {name!r}; choose one of {', '.join(self.names())}"
            ) from None
        return factory(**options)
