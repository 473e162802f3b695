"""The data a policy sees and returns. The portal builds a ClusterSnapshot from its database,
calls a policy, and writes the Plan back; the simulator does the same from a trace.

Every field added after the backbone has a default, so a snapshot built the old way still works:
a job without a throughput model is assumed to scale linearly, a device without an owner belongs
to the shared pool, and a job without step-time reports is never called a straggler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from elastic.scheduling.goodput import GradientNoise
from elastic.scheduling.throughput import ThroughputModel

Priority = Literal["guaranteed", "opportunistic"]
Consistency = Literal["strict", "hybrid"]


@dataclass(frozen=True)
class DeviceView:
    id: int
    node: str
    usable: bool = True
    """False when the device's owner took it back, its node is lost, or it vanished."""
    owner: str | None = None
    """Who the device belongs to when it is not part of the shared pool. An owned device is only
    lent: opportunistic jobs may borrow it while `owner_present` is false."""
    owner_present: bool = False
    """The owner is using the device (a process the agent did not start is on it). It is taken
    back at once: no job is planned on it, whatever else the snapshot says."""

    @property
    def available(self) -> bool:
        """The device may be given to some job in this cycle."""
        return self.usable and not self.owner_present

    @property
    def lent(self) -> bool:
        return self.owner is not None


@dataclass(frozen=True)
class JobView:
    id: int
    min_workers: int
    max_workers: int
    priority: Priority = "guaranteed"
    submitted_at: float = 0.0
    current: tuple[int, ...] = ()
    """Device ids the job holds now, in rank order."""
    pinned_workers: int | None = None
    """A manual resize: the policy gives exactly this many workers while it can."""
    requested_workers: int | None = None
    """What the user asked for: the gang size of the static baselines (FIFO, Tiresias). Defaults
    to `max_workers`."""
    consistency: Consistency = "strict"
    throughput: ThroughputModel | None = None
    """Step time against workers, nodes and per-worker batch (learned online; a prior until the
    first reports). None: the policy assumes linear scaling."""
    throughput_measured: bool = False
    """`throughput` was fitted to the job's own reports, not a prior alone: its predictions are
    worth telling people (elastic.scheduling.queue)."""
    batch_size: int | None = None
    """Global batch size: fixed in strict mode; in hybrid mode the current one."""
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    """Hybrid mode: the bounds the user allows for the global batch."""
    max_local_batch_size: int | None = None
    """The most samples one worker fits in one micro-batch; above it the worker accumulates."""
    gradient_noise: GradientNoise | None = None
    """The job's latest gradient statistics; they say how much a larger batch is worth (hybrid)."""
    attained_service_s: float = 0.0
    """Device-seconds the job has had so far."""
    virtual_workers: int | None = None
    """Strict mode: the fixed number of virtual workers; no more physical workers than this."""
    worker_step_times: tuple[tuple[float, ...], ...] = ()
    """Recent step times of each worker, aligned with `current` (oldest first)."""
    remaining_work: float | None = None
    """Work left, in base-batch steps (the progress unit of `gradient_noise`): an oracle the
    simulator knows and the Optimus-like baseline uses; the portal leaves it None."""

    @property
    def gang_size(self) -> int:
        wanted = self.requested_workers if self.requested_workers is not None else self.max_workers
        return min(max(wanted, self.min_workers), self.max_workers)


@dataclass(frozen=True)
class ClusterSnapshot:
    devices: tuple[DeviceView, ...]
    jobs: tuple[JobView, ...]
    now: float = 0.0
    """Seconds on the same clock as `JobView.submitted_at`."""


class Reason(StrEnum):
    """Why a job has what it has, as the board shows it."""

    PINNED = "pinned"
    PIN_UNMET = "pin unmet"
    MINIMUM = "minimum"
    FAIR_SHARE = "fair share"
    THROUGHPUT = "throughput"
    GANG = "requested gang"
    BORROWED = "borrowed device"
    WAITING = "waiting"
    NOT_WORTH = "more workers not worth it"
    """Devices are free that it could take, but the policy judged more workers not worth their
    cost: the plan's `notes` give the numbers it used."""
    STRAGGLER_REPLACED = "straggler replaced"
    STRAGGLER_UNLOADED = "straggler given fewer virtual workers"


@dataclass(frozen=True)
class StragglerAction:
    """What the policy does about one slow worker of one job.

    Either `replacement` is the free device that takes the slow one's rank (a migration, already
    reflected in the plan's assignment), or, in strict mode with no free device, `virtual_workers`
    gives each rank its number of virtual workers, the slow one fewer.
    """

    job_id: int
    slow_device: int
    slowdown: float
    """The slow worker's median step time over its peers' median, over the window."""
    replacement: int | None = None
    virtual_workers: tuple[int, ...] | None = None


@dataclass
class Plan:
    assignments: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Job id to the device ids it should hold, in rank order; a waiting job maps to ()."""
    pin_problems: dict[int, str] = field(default_factory=dict)
    """Job id to why its pin could not be met, for jobs whose pin is not met."""
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Hybrid jobs that run: the global batch size to use."""
    reasons: dict[int, tuple[Reason, ...]] = field(default_factory=dict)
    """Job id to why it has what it has (absent: the policy does not say)."""
    stragglers: list[StragglerAction] = field(default_factory=list)
    notes: dict[int, str] = field(default_factory=dict)
    """Job id to the policy's own words on its reason, with the numbers it used (NOT_WORTH)."""


Policy = Callable[[ClusterSnapshot], Plan]
"""A policy is a pure function: the same snapshot always gives the same plan."""
