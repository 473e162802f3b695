"""The agent's bounded event buffer: order kept, and when full, log lines go first."""

from __future__ import annotations

import pytest

from agent.events import EventBuffer
from elastic.wire import WorkerEvent


def event(kind: str, step: int) -> WorkerEvent:
    return WorkerEvent(job_id=1, generation=1, rank=0, kind=kind, at=float(step), step=step)  # type: ignore[arg-type]


def test_events_come_out_in_the_order_they_went_in() -> None:
    buffer = EventBuffer(10)
    events = [event("started", 0), event("log", 1), event("progress", 2), event("log", 3), event("exited", 4)]
    buffer.extend(events)
    assert buffer.peek() == events and buffer.peek(2) == events[:2]
    assert buffer.take() == events
    assert len(buffer) == 0


def test_a_full_buffer_drops_log_lines_then_progress_then_the_oldest() -> None:
    buffer = EventBuffer(3)
    buffer.extend([event("started", 0), event("log", 1), event("progress", 2), event("log", 3)])
    assert [e.step for e in buffer.peek()] == [0, 2, 3]
    buffer.add(event("exited", 4))
    assert [e.step for e in buffer.peek()] == [0, 2, 4]
    buffer.add(event("started", 5))
    assert [e.step for e in buffer.peek()] == [0, 4, 5]
    buffer.add(event("exited", 6))
    assert [e.step for e in buffer.peek()] == [4, 5, 6]
    assert buffer.dropped == 4


def test_remove_takes_out_only_what_was_delivered() -> None:
    buffer = EventBuffer(10)
    first = [event("started", 0), event("progress", 1)]
    buffer.extend(first)
    delivered = buffer.peek()
    buffer.add(event("progress", 2))
    buffer.remove(delivered)
    assert [e.step for e in buffer.take()] == [2]


def test_a_buffer_needs_room() -> None:
    with pytest.raises(ValueError, match="got 0"):
        EventBuffer(0)


def test_every_kind_of_event_has_a_place_in_the_buffer() -> None:
    from typing import get_args

    from agent.events import _CLASS
    from elastic.wire import WorkerEvent

    kinds = set(get_args(WorkerEvent.model_fields["kind"].annotation)) - {"exiting"}  # the supervisor's own
    assert kinds <= set(_CLASS), kinds - set(_CLASS)
