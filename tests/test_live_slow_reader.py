"""A browser that reads slower than the portal sends, over the real Redis channel layer: the
socket keeps only the newest state of a job it has not been sent yet, so that when the browser
reads again it gets few states and the current one last (none of the newer ones dropped), and a
socket that falls further behind than BUNGEE_LIVE_OUTBOX_LIMIT other messages is closed (4429)
rather than held in memory without bound. The slow browser is an ASGI server whose send waits
while the test holds it, as uvicorn's send waits while the client's TCP window is full."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from portal.asgi import application
from portal.jobs.models import Job
from portal.live import broadcast
from portal.live.consumers import TOO_FAR_BEHIND_CLOSE_CODE
from portal.redis import client
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db(transaction=True)

UPDATES = 300
"""More than the layer holds for one channel (its capacity, 100): a socket that stopped taking
messages in lost the newest ones."""


class SlowBrowser:
    """The portal's websocket application behind a server whose sends wait while `reading` is
    clear."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.reading.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def held(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.send":
                await self.reading.wait()
            await send(message)

        await application(scope, receive, held)


async def stalled(browser: SlowBrowser, token: str) -> WebsocketCommunicator:
    """A socket of `browser`'s that has had its snapshot, and whose browser reads no more."""
    live = WebsocketCommunicator(browser, "/ws/live/", headers=[
        (b"origin", b"http://127.0.0.1"), (b"authorization", f"Bearer {token}".encode())])
    connected, _ = await live.connect(timeout=30)
    assert connected
    assert (await live.receive_json_from(timeout=30))["type"] == "cluster"
    browser.reading.clear()
    return live


async def taken_in() -> None:
    """Waits (at most 30 s) until the layer holds no message for this process's sockets: the
    consumer took them all in (a consumer stuck writing takes none, and its messages stay)."""
    layer = get_channel_layer()
    redis = client()
    pattern = f"{layer.prefix}specific.*"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        waiting = await sync_to_async(lambda: sum(redis.zcard(k) for k in redis.scan_iter(match=pattern)))()
        if not waiting:
            return
        await asyncio.sleep(0.1)


async def received(live: WebsocketCommunicator) -> list[dict[str, Any]]:
    """Every message written until none came for a second."""
    messages: list[dict[str, Any]] = []
    while not await live.receive_nothing(timeout=1):
        output = await live.receive_output()
        messages.append(json.loads(output["text"]) if output["type"] == "websocket.send" else output)
    return messages


def states_of(job_id: int, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [job for m in messages if m.get("type") in ("job", "jobs")
            for job in ([m["job"]] if m["type"] == "job" else m["jobs"]) if job["id"] == job_id]


def test_a_slow_browser_gets_the_newest_state_of_a_job_and_few_of_the_older(tokens: dict, api: dict) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    browser = SlowBrowser()

    async def scenario() -> list[dict[str, Any]]:
        live = await stalled(browser, tokens["alice"])
        for update in range(1, UPDATES + 1):
            await sync_to_async(Job.objects.filter(pk=job_id).update)(name=f"update {update}")
            await sync_to_async(broadcast.job_changed)(await sync_to_async(Job.objects.get)(pk=job_id))
        await taken_in()
        browser.reading.set()
        messages = await received(live)
        await live.disconnect()
        return messages

    messages = async_to_sync(scenario)()
    names = [job["name"] for job in states_of(job_id, messages)]
    assert names and names[-1] == f"update {UPDATES}", f"the browser was left with {names[-1:]}: {names}"
    # The one being written when the browser stopped, and the newest; one more may have been on
    # its way through the layer when the browser read again.
    assert len(names) <= 3, f"{len(names)} states of the job waited for the slow browser: {names}"


def test_a_browser_too_far_behind_is_closed(tokens: dict, settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"live_outbox_limit": 10})
    browser = SlowBrowser()

    async def scenario() -> list[dict[str, Any]]:
        live = await stalled(browser, tokens["alice"])
        for number in range(30):
            await sync_to_async(broadcast.send)(broadcast.CLUSTER_GROUP, {"type": "note", "number": number})
        await taken_in()
        browser.reading.set()
        return await received(live)

    messages = async_to_sync(scenario)()
    assert messages and messages[-1].get("type") == "websocket.close", messages
    assert messages[-1]["code"] == TOO_FAR_BEHIND_CLOSE_CODE
    # What it was sent before it fell behind came in order; nothing after.
    numbers = [m["number"] for m in messages if m.get("type") == "note"]
    assert numbers == list(range(len(numbers))) and len(numbers) <= 12, numbers
