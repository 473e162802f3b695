"""A node registering again: its devices keep their rows (and ids, which samples and history
name), take the names and sizes it reports now, new ones are added, and the ones it no longer
reports are marked absent with their history kept."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.wire import DeviceInfo, NodeRegistration

pytestmark = pytest.mark.django_db


def registration(*indexes: int, name: str = "CPU slot", memory: int = 2**30) -> NodeRegistration:
    return NodeRegistration(name="node-a", address="127.0.0.1", backend="simulated", devices=[
        DeviceInfo(index=i, uuid=f"sim-{i}", name=name, kind="cpu-slot", memory_total_bytes=memory) for i in indexes])


def test_a_node_registering_again_updates_adds_and_marks_absent(redis_client: Any) -> None:
    from portal.cluster.ingest import register_node

    node, _ = register_node(registration(0, 1, 2, 3))
    ids = dict(node.devices.values_list("index", "pk"))
    register_node(registration(0, 1, 5, name="bigger slot", memory=2**31))

    rows = {d.index: d for d in node.devices.all()}
    assert sorted(rows) == [0, 1, 2, 3, 5]
    assert {i: rows[i].pk for i in (0, 1, 2, 3)} == ids, "the same rows, the same ids"
    assert [(rows[i].name, rows[i].memory_total_bytes, rows[i].present) for i in (0, 1, 5)] == [("bigger slot", 2**31, True)] * 3
    assert not rows[2].present and not rows[3].present
    register_node(registration(0, 1, 2, 3, 5))
    assert all(d.present for d in node.devices.all()), "a device reported again is present again"
