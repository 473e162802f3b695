"""Device samples on the live socket, over the real Redis channel layer: one message per node
and report whatever the number of devices, and in it only what changed since each device's
previous sample (its id and taken_at always, taken_at once for the message when the samples
share it; the whole sample once every FULL_EVERY_S)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from elastic.wire import AgentReport, DeviceSample
from portal.live.samples import FULL_EVERY_S
from tests.test_live_sockets import connect

pytestmark = pytest.mark.django_db(transaction=True)


def sample(index: int, taken_at: float, utilization_pct: float = 10.0, memory_used_bytes: int = 5) -> DeviceSample:
    return DeviceSample(index=index, taken_at=taken_at, utilization_pct=utilization_pct,
                        memory_used_bytes=memory_used_bytes, memory_total_bytes=2**30, temperature_c=40.0)


def report(cluster: Any, *samples: DeviceSample) -> None:
    from portal.jobs.agents import ingest_report

    ingest_report(cluster, AgentReport(node="node-a", samples=list(samples)))


async def opened(token: str) -> WebsocketCommunicator:
    """A socket connected, its cluster snapshot read."""
    socket = connect(token)
    assert (await socket.connect())[0]
    assert (await socket.receive_json_from(timeout=10))["type"] == "cluster"
    return socket


def a_window_start() -> float:
    """The start of the last whole FULL_EVERY_S window before now: samples taken in it share
    their window and are in the past."""
    return (time.time() // FULL_EVERY_S - 1) * FULL_EVERY_S


def test_one_message_per_report_with_every_device_in_it(tokens: dict, cluster: Any) -> None:
    device_ids = dict(cluster.devices.values_list("index", "pk"))
    at = a_window_start()

    async def scenario() -> None:
        socket = await opened(tokens["alice"])
        await database_sync_to_async(report)(cluster, *(sample(i, at + 1, 20.0 + i) for i in range(4)))
        message = await socket.receive_json_from(timeout=10)
        assert message["type"] == "samples" and message["node"] == "node-a"
        assert message["taken_at"] == at + 1, "taken once for the four, said once"
        assert [row["device_id"] for row in message["samples"]] == [device_ids[i] for i in range(4)]
        assert not any("taken_at" in row for row in message["samples"])
        assert [row["utilization_pct"] for row in message["samples"]] == [20.0, 21.0, 22.0, 23.0]
        assert await socket.receive_nothing(timeout=0.5), "one message for the report, not one per device"
        await socket.disconnect()

    async_to_sync(scenario)()


def test_only_what_changed_is_sent_and_the_whole_sample_once_a_window(tokens: dict, cluster: Any) -> None:
    device_ids = dict(cluster.devices.values_list("index", "pk"))
    at = a_window_start()

    async def scenario() -> None:
        socket = await opened(tokens["alice"])

        async def rows_after(*samples: DeviceSample) -> list[dict[str, Any]]:
            """The message's rows, each with its taken_at (from the message where it is shared)."""
            await database_sync_to_async(report)(cluster, *samples)
            message = await socket.receive_json_from(timeout=10)
            assert message["type"] == "samples"
            return [{"taken_at": message["taken_at"], **row} if "taken_at" in message else row for row in message["samples"]]

        first = await rows_after(sample(0, at + 1), sample(1, at + 1))
        assert first[0] == {"device_id": device_ids[0], "taken_at": at + 1, "index": 0, "utilization_pct": 10.0,
                            "memory_used_bytes": 5, "memory_total_bytes": 2**30, "temperature_c": 40.0,
                            "power_w": None, "processes": [], "owner_present": False}, "a first sample is whole"

        second = await rows_after(sample(0, at + 2, utilization_pct=55.0), sample(1, at + 2, memory_used_bytes=7))
        assert second == [
            {"device_id": device_ids[0], "taken_at": at + 2, "utilization_pct": 55.0},
            {"device_id": device_ids[1], "taken_at": at + 2, "memory_used_bytes": 7},
        ]

        unchanged = await rows_after(sample(0, at + 3, utilization_pct=55.0))
        assert unchanged == [{"device_id": device_ids[0], "taken_at": at + 3}]

        apart = await rows_after(sample(0, at + 4, utilization_pct=55.0), sample(1, at + 5, memory_used_bytes=7))
        assert apart == [{"device_id": device_ids[0], "taken_at": at + 4}, {"device_id": device_ids[1], "taken_at": at + 5}], \
            "taken at different times, each row says when"

        next_window = await rows_after(sample(0, at + FULL_EVERY_S, utilization_pct=55.0))
        assert next_window[0]["taken_at"] == at + FULL_EVERY_S
        assert next_window[0]["utilization_pct"] == 55.0 and next_window[0]["temperature_c"] == 40.0, \
            "the first sample of a new window is whole again"
        await socket.disconnect()

    async_to_sync(scenario)()


def test_the_latest_sample_stays_whole_for_the_snapshot(tokens: dict, cluster: Any) -> None:
    """What a socket that connects later is given (the cluster's snapshot) is each device's whole
    latest sample, not the part of it that changed."""
    at = a_window_start()
    report(cluster, sample(2, at + 1, utilization_pct=30.0))
    report(cluster, sample(2, at + 2, utilization_pct=31.0))

    async def scenario() -> None:
        socket = connect(tokens["alice"])
        assert (await socket.connect())[0]
        snapshot = await socket.receive_json_from(timeout=10)
        latest = next(d["sample"] for d in snapshot["cluster"]["nodes"][0]["devices"] if d["index"] == 2)
        assert latest["utilization_pct"] == 31.0 and latest["temperature_c"] == 40.0 and latest["taken_at"] == at + 2
        await socket.disconnect()

    async_to_sync(scenario)()
