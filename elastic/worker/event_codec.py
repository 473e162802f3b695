"""The worker event codec: how a worker's events (elastic.wire.WorkerEvent) travel on its stdout,
one line each, to whoever reads it (the agent's supervisor, or elastic.worker.local in tests
and benchmarks). One encoder and one decoder, so that both readers agree on every line.

A line is WORKER_EVENT_PREFIX and the event as a JSON object, fields that are None left out.
Decoding is lenient, because a worker's stdout also carries whatever its code prints: any line
that is not a well-formed event of a kind a worker may write becomes a log event carrying the
whole line, and a log message is cut at MAX_LOG_CHARS, so that one runaway print cannot swell
a report."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Literal, get_args

from pydantic import ValidationError

from elastic.wire import WORKER_EVENT_PREFIX, WorkerEvent

__all__ = ["MAX_LOG_CHARS", "WORKER_KINDS", "WorkerKind", "decode", "encode", "is_event_line"]

WorkerKind = Literal[
    "joined", "resized", "progress", "log", "step_times", "form_failed", "exiting", "artifacts", "evaluation"
]
"""The kinds of event a worker writes; "started" and "exited" are the supervisor's own."""
WORKER_KINDS: frozenset[str] = frozenset(get_args(WorkerKind))
MAX_LOG_CHARS = 2000
"""A log message longer than this is cut."""


def encode(event: WorkerEvent) -> str:
    """Returns the line (without its newline) that stands for `event`."""
    return WORKER_EVENT_PREFIX + event.model_dump_json(exclude_none=True)


def is_event_line(line: str) -> bool:
    """Whether `line` claims to be an event (it may still be a malformed one)."""
    return line.startswith(WORKER_EVENT_PREFIX)


def decode(key: Mapping[str, int], line: str) -> WorkerEvent:
    """Returns the event that the output line `line` (without its newline) stands for; never
    raises. `key` holds the writer's job_id, generation and rank as its reader knows them.

    A line of WORKER_EVENT_PREFIX and a JSON object of a kind in WORKER_KINDS is that event;
    fields it leaves out are taken from `key` (job, generation, rank) or the clock (`at`). Any
    other line, a malformed event or one of a kind only the supervisor writes included, is a
    log event carrying the whole line. Log messages are cut at MAX_LOG_CHARS."""
    event = None
    if is_event_line(line):
        try:
            payload = json.loads(line[len(WORKER_EVENT_PREFIX) :])
        except ValueError:
            payload = None
        if isinstance(payload, dict) and payload.get("kind") in WORKER_KINDS:
            try:
                event = WorkerEvent.model_validate({**key, "at": time.time(), **payload})
            except ValidationError:
                event = None
    if event is None:
        event = WorkerEvent.model_validate({**key, "kind": "log", "at": time.time(), "message": line})
    if event.message is not None and len(event.message) > MAX_LOG_CHARS:
        event = event.model_copy(update={"message": _cut(event.message)})
    return event


def _cut(text: str) -> str:
    return f"{text[:MAX_LOG_CHARS]}… [{len(text) - MAX_LOG_CHARS} more characters cut]"
