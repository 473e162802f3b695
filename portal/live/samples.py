"""What a device sample sends to the open sockets: only what changed since the device's previous
sample (its id and `taken_at` always; a report whose samples were all taken at once, as an
agent takes them, says `taken_at` once for all), and the whole sample when there is no previous one or
once every FULL_EVERY_S of the agent's clock, so that a socket that missed a message (the layer
drops messages to a full channel) is whole again within that time. Which sockets want which
devices is a subscription: `Subscription` says whether a socket wants a node's batch whole, in
part (some of its devices) or not at all. Plain data; no Django."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FULL_EVERY_S = 30
ALWAYS_SENT = ("device_id", "taken_at")


def changed(previous: dict[str, Any] | None, current: dict[str, Any]) -> dict[str, Any]:
    """The fields of `current` (a sample as the portal stores it, with its `device_id`) that a
    socket holding `previous` lacks: the id and `taken_at`, and each field whose value differs.
    The whole of `current` when `previous` is None or the two fall in different FULL_EVERY_S
    windows of `taken_at`."""
    if previous is None or previous["taken_at"] // FULL_EVERY_S != current["taken_at"] // FULL_EVERY_S:
        return current
    return {name: value for name, value in current.items() if name in ALWAYS_SENT or previous.get(name) != value}


def taken_together(rows: list[dict[str, Any]]) -> tuple[float | None, list[dict[str, Any]]]:
    """(taken_at, rows): when every row has the same `taken_at`, that time and the rows without
    it; else None and the rows as they are."""
    times = {row["taken_at"] for row in rows}
    if len(times) != 1:
        return None, rows
    return times.pop(), [{name: value for name, value in row.items() if name != "taken_at"} for row in rows]


@dataclass
class Subscription:
    """The samples a socket follows: every node's (`everything`, the default), or those of the
    nodes in `node_ids` and the devices in `device_ids` (a device id keyed by its node id)."""

    everything: bool = True
    node_ids: set[int] = field(default_factory=set)
    device_ids: dict[int, set[int]] = field(default_factory=dict)

    def followed_nodes(self) -> set[int]:
        return self.node_ids | set(self.device_ids)

    def wants(self, node_id: int) -> bool | set[int]:
        """True: the node's whole batch; a set: only these device ids of it; False: none."""
        if self.everything or node_id in self.node_ids:
            return True
        return self.device_ids.get(node_id, False)
