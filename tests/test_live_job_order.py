"""A job's live updates reach the pages in the order of the changes they show, however the
processes that send them interleave: the portal and the Celery worker both send them, over the
real Redis channel layer."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.db import connection, transaction

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


@dataclass
class Watched:
    job_id: int
    names: Callable[[], list[str]]
    """The names in the `job` messages the board's group got since the last call, in order."""


@pytest.fixture
def watched(api: dict) -> Iterator[Watched]:
    """A job of alice's, and a channel in the boards' group (the real Redis layer) that has
    taken the job's submission's own update."""
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(layer.new_channel())
    loop.run_until_complete(layer.group_add(broadcast.CLUSTER_GROUP, channel))
    job_names(loop, layer, channel)
    try:
        yield Watched(job_id, lambda: job_names(loop, layer, channel))
        loop.run_until_complete(layer.group_discard(broadcast.CLUSTER_GROUP, channel))
    finally:
        loop.close()


def test_an_update_read_before_another_change_is_not_sent_after_it(
    watched: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = watched.job_id

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
    names = watched.names()
    assert names[-1] == "renamed", f"the pages were left with an older job: {names}"


def test_an_update_made_in_a_transaction_is_sent_after_its_commit(watched: Watched) -> None:
    """A change and its update inside one transaction (the agent's endpoint report is one, and
    may end a worker's generation): a process that reads the job before the commit sees the
    older job, so the change's update must not go out before the commit, or it is not the last."""
    job_id = watched.job_id
    changed, commit = threading.Event(), threading.Event()

    def change_in_a_transaction() -> None:
        with transaction.atomic():
            Job.objects.filter(pk=job_id).update(name="renamed")
            broadcast.job_changed(Job.objects.get(pk=job_id))
            changed.set()
            commit.wait(30)

    writer = in_thread("writer", change_in_a_transaction)
    assert changed.wait(30), "the writer never changed the job"
    # Another process sends the job as it reads it: the rename is not committed yet.
    reader = in_thread("reader", lambda: broadcast.job_changed(Job.objects.get(pk=job_id)))
    reader.join(30)
    commit.set()
    writer.join(30)
    assert not writer.is_alive() and not reader.is_alive()
    names = watched.names()
    assert names[-1] == "renamed", f"the pages were left with an older job: {names}"
