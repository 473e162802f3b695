"""One event the portal fails on (a 5xx whenever a report carries it) cannot hold a node's
reports back for good (agent.events.PoisonIsolation): the reports halve their events down to
the culprit, test the portal without events, and drop the culprit only when the portal takes
every report but those; a portal that fails on everything loses nothing."""

from __future__ import annotations

import time

from agent.events import EventBuffer, PoisonIsolation
from elastic.wire import WorkerEvent


def events(count: int) -> list[WorkerEvent]:
    return [WorkerEvent(job_id=1, generation=1, rank=0, kind="log", at=time.time(), message=f"event {i}")
            for i in range(count)]


def deliver(buffer: EventBuffer, isolation: PoisonIsolation, fails_on: object, reports: int) -> list[str]:
    """Runs `reports` reports against a portal that answers 5xx when `fails_on(sent)`; returns
    the messages it took, in order."""
    taken: list[str] = []
    for _ in range(reports):
        sent = buffer.peek(isolation.batch_size())
        if fails_on(sent):  # type: ignore[operator]
            buffer.remove(isolation.server_failed(sent))
        else:
            taken.extend(event.message or "" for event in sent)
            isolation.succeeded(sent)
            buffer.remove(sent)
    return taken


def test_the_one_event_the_portal_fails_on_is_found_and_dropped() -> None:
    buffer, isolation = EventBuffer(10_000), PoisonIsolation(most=1000)
    buffer.extend(events(300))
    taken = deliver(buffer, isolation, lambda sent: any(e.message == "event 137" for e in sent), reports=40)
    assert taken == [f"event {i}" for i in range(300) if i != 137]
    assert not buffer.peek()


def test_a_portal_that_fails_on_every_report_loses_nothing() -> None:
    buffer, isolation = EventBuffer(10_000), PoisonIsolation(most=1000)
    buffer.extend(events(50))
    assert deliver(buffer, isolation, lambda sent: True, reports=60) == []
    assert len(buffer.peek()) == 50
    assert deliver(buffer, isolation, lambda sent: False, reports=60) == [f"event {i}" for i in range(50)]
