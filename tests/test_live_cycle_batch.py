"""A scheduling cycle sends the boards every job it changed as one message: each new job moves
every queued job's place, and one message per job made a burst of submissions quadratic in
messages per socket. Over the real Redis channel layer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from channels.layers import get_channel_layer

from portal.live import broadcast
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC

TOO_BIG = {**VALID_SPEC, "min_workers": 5, "max_workers": 5}
"""A job that waits in the queue of the `cluster` fixture's four devices."""

pytestmark = pytest.mark.django_db(transaction=True)


def board_messages(loop: asyncio.AbstractEventLoop, layer: Any, channel: str) -> list[dict[str, Any]]:
    async def drain() -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        while True:
            try:
                message = await asyncio.wait_for(layer.receive(channel), timeout=1.0)
            except TimeoutError:
                return messages
            messages.append(json.loads(message["text"]))

    return loop.run_until_complete(drain())


def test_a_cycle_sends_the_jobs_it_changed_as_one_message(api: dict, cluster: Any) -> None:
    queued = [api["alice"].post("/api/jobs", TOO_BIG).json()["id"] for _ in range(3)]
    run_cycle()
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    try:
        channel = loop.run_until_complete(layer.new_channel())
        loop.run_until_complete(layer.group_add(broadcast.CLUSTER_GROUP, channel))
        newest = api["alice"].post("/api/jobs", TOO_BIG).json()["id"]
        run_cycle()
        messages = board_messages(loop, layer, channel)
        loop.run_until_complete(layer.group_discard(broadcast.CLUSTER_GROUP, channel))
    finally:
        loop.close()
    # The submission's own update, and one cycle's: the four queued jobs, each in the queue of
    # four. Which comes first depends on whether the submission's own cycle ran (eager Celery,
    # after its commit, ahead of the update) or found the scheduler's lock held by another test
    # and left it to the explicit cycle; either way the queue moved once, in one message.
    [single] = [m for m in messages if m["type"] == "job"]
    [batch] = [m for m in messages if m["type"] == "jobs"]
    assert len(messages) == 2, messages
    assert single["job"]["id"] == newest
    assert sorted(job["id"] for job in batch["jobs"]) == [*queued, newest]
    assert {job["queue"]["waiting"] for job in batch["jobs"]} == {4}
