"""The data a policy sees and returns. The portal builds a ClusterSnapshot from its database,
calls a policy, and writes the Plan back; the simulator does the same from a trace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class DeviceView:
    id: int
    node: str
    usable: bool = True
    """False when the device's owner took it back, its node is lost, or it vanished."""


@dataclass(frozen=True)
class JobView:
    id: int
    min_workers: int
    max_workers: int
    priority: Literal["guaranteed", "opportunistic"] = "guaranteed"
    submitted_at: float = 0.0
    current: tuple[int, ...] = ()
    """Device ids the job holds now, in rank order."""
    pinned_workers: int | None = None
    """A manual resize: the policy gives exactly this many workers while it can."""


@dataclass(frozen=True)
class ClusterSnapshot:
    devices: tuple[DeviceView, ...]
    jobs: tuple[JobView, ...]


@dataclass
class Plan:
    assignments: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Job id to the device ids it should hold, in rank order; a waiting job maps to ()."""
    pin_problems: dict[int, str] = field(default_factory=dict)
    """Job id to why its pin could not be met, for jobs whose pin is not met."""
