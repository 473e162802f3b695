"""Turning worker counts into devices: keep what a job holds, grow it near itself.

Every policy decides how many workers each job gets; this module decides which devices. A resize
costs the job a pause and a move across nodes slows its all-reduce, so placement (1) keeps every
device a job already holds when its count allows, dropping first the devices on the nodes where
it has the fewest when it shrinks, and (2) grows a job first on the nodes it is already on, then
on the free node that fits the rest best (the smallest node with enough free devices, or else
the node with the most). Jobs that grow the most are placed first, so that big jobs find whole
nodes. Devices some other job may lose (an opportunistic job's shared devices, for a guaranteed
job) are taken only when nothing else is free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from elastic.scheduling.api import DeviceView, JobView


@dataclass(frozen=True)
class Request:
    job: JobView
    count: int


class FreeDevices:
    """The devices not yet given out in this cycle, grouped by node, in two tiers: `first` are
    taken before `second`."""

    def __init__(self, devices: Iterable[DeviceView], second: set[int] | None = None) -> None:
        second = second or set()
        self._node_of: dict[int, str] = {}
        self._tiers: list[dict[str, list[int]]] = [{}, {}]
        for device in sorted(devices, key=lambda d: d.id):
            self._node_of[device.id] = device.node
            tier = self._tiers[1 if device.id in second else 0]
            tier.setdefault(device.node, []).append(device.id)

    def __contains__(self, device_id: int) -> bool:
        node = self._node_of.get(device_id)
        return node is not None and any(device_id in tier.get(node, ()) for tier in self._tiers)

    def __len__(self) -> int:
        return sum(len(ids) for tier in self._tiers for ids in tier.values())

    def node_of(self, device_id: int) -> str:
        return self._node_of[device_id]

    def remove(self, device_id: int) -> None:
        node = self._node_of[device_id]
        for tier in self._tiers:
            ids = tier.get(node)
            if ids and device_id in ids:
                ids.remove(device_id)
                if not ids:
                    del tier[node]
                return

    def take(self, need: int, near: Counter[str]) -> list[int]:
        """Up to `need` devices: on the nodes in `near` first (most devices there first), then
        by best fit. Updates `near` with what it took."""
        taken: list[int] = []
        for tier in self._tiers:
            while need > len(taken) and tier:
                missing = need - len(taken)
                node = self._pick_node(tier, missing, near)
                ids = tier[node]
                grabbed = ids[:missing]
                del ids[: len(grabbed)]
                if not ids:
                    del tier[node]
                taken.extend(grabbed)
                near[node] += len(grabbed)
        return taken

    @staticmethod
    def _pick_node(tier: dict[str, list[int]], missing: int, near: Counter[str]) -> str:
        own = [node for node in tier if near.get(node)]
        if own:
            return min(own, key=lambda n: (-near[n], -len(tier[n]), n))
        fitting = [node for node, ids in tier.items() if len(ids) >= missing]
        if fitting:
            return min(fitting, key=lambda n: (len(tier[n]), n))
        return min(tier, key=lambda n: (-len(tier[n]), n))


def keep_current(job: JobView, count: int, free: FreeDevices) -> list[int]:
    """The devices of `job.current` it keeps at `count` workers (rank order preserved); removes
    them from `free`."""
    mine = [d for d in job.current if d in free]
    if len(mine) > count:
        per_node = Counter(free.node_of(d) for d in mine)
        ranked = sorted(
            mine, key=lambda d: (-per_node[free.node_of(d)], free.node_of(d), job.current.index(d))
        )
        chosen = set(ranked[:count])
        mine = [d for d in mine if d in chosen]
    for device_id in mine:
        free.remove(device_id)
    return mine


def place(requests: Sequence[Request], free: FreeDevices) -> dict[int, tuple[int, ...]]:
    """Devices for every request, taken from `free` (which it updates). A request that cannot be
    met in full gets what is left; callers size requests to what is free, so that does not
    happen in a consistent plan."""
    kept = {r.job.id: keep_current(r.job, r.count, free) for r in requests}
    result: dict[int, tuple[int, ...]] = {}
    growing = sorted(requests, key=lambda r: (-(r.count - len(kept[r.job.id])), r.job.id))
    for request in growing:
        devices = kept[request.job.id]
        need = request.count - len(devices)
        if need > 0:
            near = Counter(free.node_of(d) for d in devices) if devices else Counter()
            devices = devices + free.take(need, near)
        result[request.job.id] = tuple(devices)
    return result
