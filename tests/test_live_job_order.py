"""A job's live updates reach the pages in the order of the changes they show, however the
processes that send them interleave: the portal and the Celery worker both send them, over the
real Redis channel layer."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.db import connection

from portal.jobs.models import Job
from portal.live import broadcast
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db(transaction=True)


def in_thread(name: str, work: Callable[[], None]) -> threading.Thread:
    """Runs `work` in a thread of its own with its own database connection, closed after."""

    def run() -> None:
        try:
            work()
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def job_names(loop: asyncio.AbstractEventLoop, layer: Any, channel: str) -> list[str]:
    """The names in the `job` messages the channel holds, in the order they came (received on
    `loop`, the one loop the layer's receiving is bound to)."""

    async def drain() -> list[str]:
        names = []
        while True:
            try:
                message = await asyncio.wait_for(layer.receive(channel), timeout=1.0)
            except TimeoutError:
                return names
            event = json.loads(message["text"])
            if event["type"] == "job":
                names.append(event["job"]["name"])

    return loop.run_until_complete(drain())


def test_an_update_read_before_another_change_is_not_sent_after_it(
    api: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(layer.new_channel())
    loop.run_until_complete(layer.group_add(broadcast.CLUSTER_GROUP, channel))
    job_names(loop, layer, channel)  # the submission's own update, if it came after the join

    # The slow sender reads the job, then stalls before it sends (a busy machine's scheduler).
    read, go_on = threading.Event(), threading.Event()
    summary = Job.summary

    def stalling_summary(job: Job) -> dict[str, Any]:
        found = summary(job)
        if threading.current_thread().name == "slow":
            read.set()
            go_on.wait(30)
        return found

    monkeypatch.setattr(Job, "summary", stalling_summary)
    slow = in_thread("slow", lambda: broadcast.job_changed(Job.objects.get(pk=job_id)))
    assert read.wait(30), "the slow sender never read the job"
    # Meanwhile another process changes the job and sends the update.
    Job.objects.filter(pk=job_id).update(name="renamed")
    fast = in_thread("fast", lambda: broadcast.job_changed(Job.objects.get(pk=job_id)))
    fast.join(0.5)  # unordered, it has sent by now; in order, it waits for the slow one
    go_on.set()
    slow.join(30)
    fast.join(30)
    assert not slow.is_alive() and not fast.is_alive()
    try:
        names = job_names(loop, layer, channel)
        loop.run_until_complete(layer.group_discard(broadcast.CLUSTER_GROUP, channel))
    finally:
        loop.close()
    assert names[-1] == "renamed", f"the pages were left with an older job: {names}"
