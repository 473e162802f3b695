"""A page names what it shows and the socket sends only those samples, over the real Redis
channel layer: a socket that says nothing gets every node's; one that names nodes gets those
nodes' batches; one that names devices gets only their rows; `all` widens it again. The other
rules of the socket (who may connect, who may follow a job) are test_live_sockets'."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from elastic.wire import AgentReport, DeviceInfo, NodeRegistration
from tests.test_live_sample_batches import a_window_start, opened, sample

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def node_b(cluster: Any) -> Any:
    from portal.cluster.ingest import register_node

    node, _ = register_node(NodeRegistration(
        name="node-b", address="127.0.0.2", backend="simulated",
        devices=[DeviceInfo(index=i, uuid=f"sim-b-{i}", name="CPU slot", kind="cpu-slot", memory_total_bytes=2**30)
                 for i in range(2)],
    ))
    return node


def report(node: Any, *indexes: int, at: float) -> None:
    from portal.jobs.agents import ingest_report

    ingest_report(node, AgentReport(node=node.name, samples=[sample(i, at) for i in indexes]))


async def subscribed(socket: WebsocketCommunicator, **what: Any) -> dict[str, Any]:
    await socket.send_json_to({"action": "subscribe_samples", **what})
    reply = await socket.receive_json_from(timeout=10)
    assert reply["type"] == "subscribed_samples", reply
    return dict(reply)


def test_each_socket_gets_the_samples_it_subscribed_to(tokens: dict, cluster: Any, node_b: Any) -> None:
    a_ids = dict(cluster.devices.values_list("index", "pk"))
    b_ids = dict(node_b.devices.values_list("index", "pk"))
    at = a_window_start()

    async def scenario() -> None:
        everything, board_a, job_page, board_b = [await opened(tokens["alice"]) for _ in range(4)]
        assert await subscribed(board_a, nodes=["node-a", "no-such-node"]) == {
            "type": "subscribed_samples", "all": False, "nodes": ["node-a"], "device_ids": []}
        assert await subscribed(job_page, device_ids=[a_ids[1], b_ids[0], 999_999]) == {
            "type": "subscribed_samples", "all": False, "nodes": [], "device_ids": sorted([a_ids[1], b_ids[0]])}
        assert (await subscribed(board_b, nodes=["node-b"]))["nodes"] == ["node-b"]

        await database_sync_to_async(report)(cluster, 0, 1, 2, 3, at=at + 1)
        rows = lambda message: [row["device_id"] for row in message["samples"]]  # noqa: E731
        for socket in (everything, board_a):
            assert rows(await socket.receive_json_from(timeout=10)) == [a_ids[i] for i in range(4)]
        job_rows = await job_page.receive_json_from(timeout=10)
        assert job_rows["node"] == "node-a" and rows(job_rows) == [a_ids[1]]
        assert job_rows["samples"][0]["utilization_pct"] == 10.0 and job_rows["taken_at"] == at + 1
        assert await board_b.receive_nothing(timeout=0.5)

        await database_sync_to_async(report)(node_b, 0, 1, at=at + 1)
        assert rows(await everything.receive_json_from(timeout=10)) == [b_ids[0], b_ids[1]]
        assert rows(await board_b.receive_json_from(timeout=10)) == [b_ids[0], b_ids[1]]
        assert rows(await job_page.receive_json_from(timeout=10)) == [b_ids[0]]
        assert await board_a.receive_nothing(timeout=0.5)

        assert (await subscribed(board_a, all=True))["all"] is True
        assert await subscribed(board_b, nodes=[], device_ids=[]) == {
            "type": "subscribed_samples", "all": False, "nodes": [], "device_ids": []}
        await database_sync_to_async(report)(node_b, 1, at=at + 2)
        assert rows(await board_a.receive_json_from(timeout=10)) == [b_ids[1]]
        assert rows(await everything.receive_json_from(timeout=10)) == [b_ids[1]]
        assert await job_page.receive_nothing(timeout=0.5), "a device it does not follow"
        assert await board_b.receive_nothing(timeout=0.5), "it follows nothing now"
        for socket in (everything, board_a, job_page, board_b):
            await socket.disconnect()

    async_to_sync(scenario)()


def test_a_subscription_that_is_not_a_list_of_names_and_ids_is_refused(tokens: dict, cluster: Any) -> None:
    async def scenario() -> None:
        socket = await opened(tokens["bob"])
        for wrong in ({"nodes": "node-a"}, {"device_ids": ["1"]}, {"device_ids": [True]}, {"nodes": [None]}):
            await socket.send_json_to({"action": "subscribe_samples", **wrong})
            refusal = await socket.receive_json_from(timeout=10)
            assert refusal["type"] == "error" and "must be a list" in refusal["message"]
        await database_sync_to_async(report)(cluster, 0, at=a_window_start() + 1)
        assert (await socket.receive_json_from(timeout=10))["type"] == "samples", "a refused subscription changes nothing"
        await socket.disconnect()

    async_to_sync(scenario)()
