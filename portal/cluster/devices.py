"""A device's identifiers, mapped in one place. Inside the portal a device is its `Device` row,
named by its id (allocations, worker rows, the scheduler's plans); outside it, on the wire to
agents and workers and in membership records, it is its member key "node/index"
(elastic.wire.member_key, which `str(device)` gives). Whoever turns one into the other calls this
module: `device_id` for what an agent reported, and `ClusterDevices` for a scheduling cycle, which
reads every device once and then names them from memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from portal.cluster.models import Device, Node


def node_of(key: str) -> str:
    """The node name of member key `key` (as resize records store them)."""
    return key.partition("/")[0]


def device_id(node: Node, index: int | None) -> int | None:
    """The id of device `index` of `node`, as its agent names it in a report; None for no
    index or one the node never registered. One query."""
    if index is None:
        return None
    return Device.objects.filter(node=node, index=index).values_list("pk", flat=True).first()


@dataclass(frozen=True)
class ClusterDevices:
    """Every device with its node, read once, by id."""

    by_id: Mapping[int, Device]

    @classmethod
    def read(cls) -> ClusterDevices:
        """Reads the Device table (one query, nodes joined)."""
        return cls(by_id={d.pk: d for d in Device.objects.select_related("node")})

    def key(self, device: int) -> str:
        """The member key of device id `device`; the id itself for a device not read."""
        known = self.by_id.get(device)
        return str(known) if known is not None else str(device)

    def keys(self, devices: tuple[int, ...] | list[int]) -> list[str]:
        return [self.key(d) for d in devices]
