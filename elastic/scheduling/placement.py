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

from bisect import bisect_left, insort
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
    taken before `second`.

    Each tier also files its nodes by how many free devices they have (names sorted within each
    count), so that the best-fitting node is found without scanning every node: at 2,048
    devices the scans were most of the time placement took."""

    def __init__(self, devices: Iterable[DeviceView], second: set[int] | None = None) -> None:
        second = second or set()
        self._node_of: dict[int, str] = {}
        self._tiers: list[dict[str, list[int]]] = [{}, {}]
        for device in sorted(devices, key=lambda d: d.id):
            self._node_of[device.id] = device.node
            tier = self._tiers[1 if device.id in second else 0]
            tier.setdefault(device.node, []).append(device.id)
        self._size = sum(len(ids) for tier in self._tiers for ids in tier.values())
        self._by_free: list[dict[int, list[str]]] = [{}, {}]
        for tier, by_free in zip(self._tiers, self._by_free, strict=True):
            for node, ids in tier.items():
                by_free.setdefault(len(ids), []).append(node)
            for nodes in by_free.values():
                nodes.sort()

    def __contains__(self, device_id: int) -> bool:
        node = self._node_of.get(device_id)
        return node is not None and any(device_id in tier.get(node, ()) for tier in self._tiers)

    def __len__(self) -> int:
        return self._size

    def node_of(self, device_id: int) -> str:
        return self._node_of[device_id]

    def remove(self, device_id: int) -> None:
        node = self._node_of[device_id]
        for index, tier in enumerate(self._tiers):
            ids = tier.get(node)
            if ids and device_id in ids:
                ids.remove(device_id)
                self._refile(index, node, len(ids) + 1)
                return

    def take(self, need: int, near: Counter[str]) -> list[int]:
        """Up to `need` devices: on the nodes in `near` first (most devices there first), then
        by best fit. Updates `near` with what it took."""
        taken: list[int] = []
        for index, tier in enumerate(self._tiers):
            while need > len(taken) and tier:
                missing = need - len(taken)
                node = self._pick_node(index, missing, near)
                ids = tier[node]
                grabbed = ids[:missing]
                del ids[: len(grabbed)]
                self._refile(index, node, len(ids) + len(grabbed))
                taken.extend(grabbed)
                near[node] += len(grabbed)
        return taken

    def _refile(self, index: int, node: str, had: int) -> None:
        """`node` of tier `index` had `had` free devices and has fewer now."""
        tier, by_free = self._tiers[index], self._by_free[index]
        has = len(tier[node])
        self._size -= had - has
        nodes = by_free[had]
        del nodes[bisect_left(nodes, node)]
        if not nodes:
            del by_free[had]
        if has:
            insort(by_free.setdefault(has, []), node)
        else:
            del tier[node]

    def _pick_node(self, index: int, missing: int, near: Counter[str]) -> str:
        """The tier's node the job already has most devices on (then the fullest, then by name);
        else the one with the fewest free devices that still holds `missing` (then by name); else
        the one with the most (then by name)."""
        tier, by_free = self._tiers[index], self._by_free[index]
        own = [node for node, count in near.items() if count and node in tier]
        if own:
            return min(own, key=lambda n: (-near[n], -len(tier[n]), n))
        fitting = [free for free in by_free if free >= missing]
        return by_free[min(fitting) if fitting else max(by_free)][0]


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
