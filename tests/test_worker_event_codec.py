"""The worker event codec (elastic.worker.event_codec), which both the agent's supervisor and
elastic.worker.local read the workers' stdout with: every event a worker writes decodes back
equal; any other line, malformed or of a kind only the supervisor writes, is a log line; a long
message is cut."""

from __future__ import annotations

import io
from typing import get_args

import pytest

from elastic.wire import WORKER_EVENT_PREFIX, WorkerEvent
from elastic.worker.event_codec import MAX_LOG_CHARS, WORKER_KINDS, decode, encode, is_event_line
from elastic.worker.events import EventWriter
from tests.test_worker_events import CONFIG

KEY = {"job_id": 5, "generation": 2, "rank": 1}

EVENTS = [
    WorkerEvent(job_id=5, generation=3, rank=0, kind="log", at=1.0, message="hi"),
    WorkerEvent(job_id=5, generation=3, rank=0, kind="exiting", at=9.0, exit_code=0),
    WorkerEvent(job_id=5, generation=3, rank=0, kind="joined", at=2.5, pid=42),
    WorkerEvent(
        job_id=5,
        generation=3,
        rank=0,
        kind="progress",
        at=3.0,
        step=4,
        total_steps=10,
        loss=0.5,
        epoch=0.25,
        samples_per_s=100.0,
        global_batch=64,
        lr=0.1,
        metrics={"accuracy": 0.75},
    ),
    WorkerEvent(
        job_id=5,
        generation=4,
        rank=0,
        kind="resized",
        at=4.0,
        step=7,
        members_before=["n/0"],
        members_after=["n/0", "n/1"],
        pause_s=0.4,
        bytes_moved=1024,
        phases={"rendezvous": 0.1},
    ),
    WorkerEvent(job_id=5, generation=3, rank=1, kind="step_times", at=5.0, step_times=[0.1, 0.2]),
    WorkerEvent(
        job_id=5,
        generation=3,
        rank=0,
        kind="form_failed",
        at=6.0,
        failed_generation=4,
        message="could not form generation 4: timeout",
    ),
    WorkerEvent(job_id=5, generation=3, rank=0, kind="artifacts", at=7.0, step=9, message="/runs/job-5/artifacts"),
    WorkerEvent(job_id=5, generation=3, rank=0, kind="evaluation", at=8.0, step=9, metrics={"accuracy": 0.8}),
]


@pytest.mark.parametrize("event", EVENTS, ids=[event.kind for event in EVENTS])
def test_an_encoded_event_decodes_back_equal(event: WorkerEvent) -> None:
    line = encode(event)
    assert "\n" not in line
    assert is_event_line(line)
    assert decode(KEY, line) == event


def test_every_kind_a_worker_writes_is_decoded() -> None:
    assert WORKER_KINDS == {e.kind for e in EVENTS}
    assert WORKER_KINDS < set(get_args(WorkerEvent.model_fields["kind"].annotation))


def test_what_the_event_writer_writes_decodes_back_equal() -> None:
    stream = io.StringIO()
    written = [
        EventWriter(CONFIG, stream).log("resumed"),
        EventWriter(CONFIG, stream).emit("form_failed", failed_generation=3, message="timeout"),
    ]
    key = {"job_id": CONFIG.job_id, "generation": CONFIG.generation, "rank": CONFIG.rank}
    assert [decode(key, line) for line in stream.getvalue().splitlines()] == written


def test_an_event_line_becomes_that_event_with_the_missing_key_filled_in() -> None:
    event = decode(KEY, WORKER_EVENT_PREFIX + '{"kind": "progress", "step": 4, "loss": 0.5}')
    assert (event.kind, event.step, event.loss) == ("progress", 4, 0.5)
    assert (event.job_id, event.generation, event.rank) == (5, 2, 1)


@pytest.mark.parametrize(
    "line",
    [
        "plain output",
        WORKER_EVENT_PREFIX + "{broken",
        WORKER_EVENT_PREFIX + "[1, 2]",
        WORKER_EVENT_PREFIX + '{"kind": "progress", "step": "many"}',
        WORKER_EVENT_PREFIX + '{"kind": "exited", "exit_code": 0}',
        WORKER_EVENT_PREFIX + '{"kind": "started", "pid": 1}',
        # The job's environment is the agent's to report, never the job's code (which prints this).
        WORKER_EVENT_PREFIX + '{"kind": "environment", "own_packages": {"digest": "' + "0" * 64 + '"}}',
        WORKER_EVENT_PREFIX + '{"kind": "teleported"}',
        WORKER_EVENT_PREFIX + '{"step": 3}',
    ],
)
def test_any_other_line_is_a_log_line(line: str) -> None:
    event = decode(KEY, line)
    assert (event.kind, event.message, event.job_id, event.generation, event.rank) == ("log", line, 5, 2, 1)


def test_a_very_long_line_is_cut() -> None:
    event = decode(KEY, "y" * (MAX_LOG_CHARS + 500))
    assert event.message is not None
    assert event.message.startswith("y" * MAX_LOG_CHARS)
    assert event.message.endswith("[500 more characters cut]")
    long_log = WORKER_EVENT_PREFIX + '{"kind": "log", "message": "' + "z" * (MAX_LOG_CHARS + 1) + '"}'
    assert (decode(KEY, long_log).message or "").endswith("[1 more characters cut]")
    exact = "x" * MAX_LOG_CHARS
    assert decode(KEY, exact).message == exact
