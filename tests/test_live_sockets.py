"""The live socket over the real Redis channel layer: anonymous sockets refused, a logged-in
one gets the cluster and its samples, and only a job's owner (or staff) may follow the job."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from elastic.wire import AgentReport, DeviceSample
from portal.asgi import application
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db(transaction=True)


def connect(token: str | None, origin: bytes | None = b"http://127.0.0.1", cookie: bytes | None = None) -> WebsocketCommunicator:
    headers = [(b"origin", origin)] if origin is not None else []
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if cookie:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, "/ws/live/", headers=headers)


def test_anonymous_socket_is_refused(db: Any) -> None:
    async def scenario() -> None:
        connected, code = await connect(None).connect()
        assert not connected

    async_to_sync(scenario)()


def test_a_script_needs_no_origin_but_a_cross_site_page_is_refused(tokens: dict, client: Any, django_user_model: Any) -> None:
    """A browser sends an Origin with every handshake; a script with a bearer token need not.
    Without an Origin only the bearer token speaks (a session cookie alone is refused), and a
    page of another site is refused even with a valid token."""
    django_user_model.objects.create_user("carol", password="pw-carol-123")
    client.force_login(django_user_model.objects.get(username="carol"))
    session = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def outcome(socket: WebsocketCommunicator) -> bool:
        connected, _ = await socket.connect(timeout=10)
        if connected:
            assert (await socket.receive_json_from(timeout=10))["type"] == "cluster"
            await socket.disconnect()
        return connected

    async def scenario() -> None:
        assert await outcome(connect(tokens["alice"], origin=None)), "a script's bearer token, no Origin"
        assert not await outcome(connect(None, origin=None)), "no Origin and no token"
        assert not await outcome(connect("bng_not-a-token", origin=None)), "no Origin and a wrong token"
        assert not await outcome(connect(None, origin=None, cookie=session)), "no Origin: a cookie alone does not speak"
        assert await outcome(connect(None, cookie=session)), "this portal's page with its session"
        assert not await outcome(connect(tokens["alice"], origin=b"https://evil.example")), "a cross-site page"
        assert not await outcome(connect(None, origin=b"https://evil.example", cookie=session)), "a cross-site page"

    async_to_sync(scenario)()


def test_samples_and_job_events_reach_the_right_sockets(tokens: dict, api: dict, cluster: Any) -> None:
    from portal.jobs.agents import ingest_report

    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]

    async def scenario() -> None:
        alice, bob = connect(tokens["alice"]), connect(tokens["bob"])
        for socket in (alice, bob):
            connected, _ = await socket.connect()
            assert connected
            first = await socket.receive_json_from(timeout=5)
            assert first["type"] == "cluster" and len(first["cluster"]["nodes"][0]["devices"]) == 4

        await bob.send_json_to({"action": "subscribe_job", "job_id": job_id})
        refusal = await bob.receive_json_from(timeout=5)
        assert refusal["type"] == "error" and "not yours" in refusal["message"]
        await alice.send_json_to({"action": "subscribe_job", "job_id": job_id})
        assert (await alice.receive_json_from(timeout=5))["type"] == "subscribed"
        await alice.send_json_to({"action": "subscribe_job", "job_id": "x"})
        assert (await alice.receive_json_from(timeout=5))["type"] == "error"

        taken_at = time.time()
        sample = DeviceSample(index=2, taken_at=taken_at, utilization_pct=37.5, memory_used_bytes=5,
                              memory_total_bytes=10)
        from channels.db import database_sync_to_async

        await database_sync_to_async(ingest_report)(cluster, AgentReport(node="node-a", samples=[sample]))
        for socket in (alice, bob):
            message = await socket.receive_json_from(timeout=5)
            assert message["type"] == "samples"
            assert message["samples"][0]["utilization_pct"] == 37.5
            assert message["taken_at"] == taken_at

        from portal.live import broadcast

        await database_sync_to_async(broadcast.send)(broadcast.job_group(job_id), {"type": "log", "line": "hello"})
        assert (await alice.receive_json_from(timeout=5))["line"] == "hello"
        assert await bob.receive_nothing(timeout=0.5)
        for socket in (alice, bob):
            await socket.disconnect()

    async_to_sync(scenario)()


def test_a_live_socket_renews_its_groups_and_a_dead_one_drops_out(
    tokens: dict, cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups expire after the layer's group_expiry (120 s, not channels' default day), so the
    sockets of a killed portal stop being written to; a live socket renews its memberships every
    third of that (here made 0.1 s)."""
    from channels.layers import get_channel_layer

    from portal.live import consumers
    from portal.live.broadcast import CLUSTER_GROUP

    layer = get_channel_layer()
    assert layer.group_expiry == 120
    monkeypatch.setattr(consumers, "renew_every_s", lambda: 0.1)
    group_key = layer._group_key(CLUSTER_GROUP)

    async def scenario() -> None:
        socket = connect(tokens["alice"])
        connected, _ = await socket.connect()
        assert connected
        await socket.receive_json_from(timeout=10)  # the cluster
        redis = layer.connection(layer.consistent_hash(CLUSTER_GROUP))
        members = await redis.zrange(group_key, 0, -1, withscores=True)
        assert len(members) == 1
        (channel, joined_at), = members
        await asyncio.sleep(0.5)
        renewed = await redis.zscore(group_key, channel)
        assert renewed > joined_at + 0.2, "the live socket renewed its membership"
        # A socket of a portal that was killed: it joined 200 s ago and never renewed.
        await redis.zadd(group_key, {"specific.dead!gone": time.time() - 200})
        await layer.group_send(CLUSTER_GROUP, {"type": "live.event", "event": {"type": "ping"}})
        assert await socket.receive_json_from(timeout=10) == {"type": "ping"}
        remaining = {member for member, _ in await redis.zrange(group_key, 0, -1, withscores=True)}
        assert remaining == {channel}, "the dead socket dropped out of the group"
        await socket.disconnect()

    async_to_sync(scenario)()


@pytest.mark.timeout(120)
def test_every_consumer_ends_when_its_socket_closes(tokens: dict, cluster: Any) -> None:
    """When a socket closes, channels cancels the consumer's pending receive from the layer and
    waits for it. Before portal.live.redis_connection, redis-py's write under Python 3.11's
    wait_for lost that cancellation when it came as the write finished: the receive popped the
    channel forever and the consumer never ended (3 runs in 3 within their first 24 sockets).
    Accepted and refused sockets alike must end by themselves, each within 10 s of closing.
    The test waits on each consumer without cancelling it: a cancellation is what could be lost."""
    from channels.layers import get_channel_layer

    from portal.live.redis_connection import CancellableConnection

    pool = get_channel_layer().create_pool(0)  # type: ignore[attr-defined]
    assert pool.connection_class is CancellableConnection, "the layer writes through the cancellable connection"

    async def one(token: str | None) -> str | None:
        socket = connect(token)
        connected, _ = await socket.connect(timeout=10)
        if connected:
            assert (await socket.receive_json_from(timeout=10))["type"] == "cluster"
        await socket.send_input({"type": "websocket.disconnect", "code": 1000})
        done, _ = await asyncio.wait([socket.future], timeout=10)
        if not done:
            return f"the consumer of a {'logged-in' if token else 'refused'} socket did not end within 10 s"
        return None

    async def scenario() -> list[str]:
        stuck = []
        for i in range(48):
            problem = await one(tokens["alice"] if i % 2 else None)
            if problem is not None:
                stuck.append(f"socket {i}: {problem}")
        return stuck

    assert async_to_sync(scenario)() == []
