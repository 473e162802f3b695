"""Sockets that connect together share one cluster snapshot (portal.live.consumers.
SharedSnapshot), over the real Redis channel layer: each still gets the cluster, and a sample
ingested while they connect reaches every one of them, in its snapshot or after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from tests.test_live_sample_batches import a_window_start, report, sample
from tests.test_live_sockets import connect

pytestmark = pytest.mark.django_db(transaction=True)
SOCKETS = 8


def test_sockets_connecting_together_each_get_the_cluster_and_miss_no_sample(tokens: dict, cluster: Any) -> None:
    at = a_window_start()
    device_id = cluster.devices.get(index=0).pk

    async def scenario() -> None:
        sockets = [connect(tokens["alice"]) for _ in range(SOCKETS)]
        outcomes = await asyncio.gather(
            *(socket.connect(timeout=30) for socket in sockets),
            database_sync_to_async(report)(cluster, sample(0, at + 1, utilization_pct=64.0)),
        )
        assert all(connected for connected, _ in outcomes[:SOCKETS])
        for socket in sockets:
            snapshot = await socket.receive_json_from(timeout=30)
            assert snapshot["type"] == "cluster" and len(snapshot["cluster"]["nodes"][0]["devices"]) == 4
            held = next(d["sample"] for d in snapshot["cluster"]["nodes"][0]["devices"] if d["id"] == device_id)
            if held is None or held["taken_at"] != at + 1:
                message = await socket.receive_json_from(timeout=30)
                assert message["type"] == "samples" and message["taken_at"] == at + 1, message
                held = {**(held or {}), **message["samples"][0]}
            assert held["utilization_pct"] == 64.0
            await socket.disconnect()

    async_to_sync(scenario)()
