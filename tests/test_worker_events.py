"""The worker's events: one prefixed JSON line each that parses back as a WorkerEvent; progress
reported on the first step, then at most once an interval, and whenever forced."""

from __future__ import annotations

import io

from elastic.wire import WORKER_EVENT_PREFIX, WorkerConfig, WorkerEvent
from elastic.worker.events import EventWriter, ProgressReporter

CONFIG = WorkerConfig(
    job_id=7,
    generation=3,
    rank=0,
    world_size=2,
    master_addr="127.0.0.1",
    master_port=1234,
    device="cpu",
    spec={},
    run_dir="/tmp/run",
    node="node-a",
    device_index=0,
    redis_url="redis://127.0.0.1:6379/13",
    coordination_key="bungee-test:job:7",
)


def _events(stream: io.StringIO) -> list[WorkerEvent]:
    lines = stream.getvalue().splitlines()
    assert all(line.startswith(WORKER_EVENT_PREFIX) for line in lines)
    return [WorkerEvent.model_validate_json(line.removeprefix(WORKER_EVENT_PREFIX)) for line in lines]


def test_log_event_carries_the_worker_key() -> None:
    stream = io.StringIO()
    EventWriter(CONFIG, stream).log("resumed from step 4")
    [event] = _events(stream)
    assert (event.job_id, event.generation, event.rank) == (7, 3, 0)
    assert (event.kind, event.message) == ("log", "resumed from step 4")


def test_progress_is_rate_limited_except_first_and_forced() -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(
        EventWriter(CONFIG, stream), total_steps=10, batch_size=4, samples_per_epoch=8, every_s=3600
    )
    reporter.restart_clock()
    written = [reporter.step_done(step, 1.0 / step, 4, force=step == 10) for step in range(1, 11)]
    assert written == [True] + [False] * 8 + [True]
    first, last = _events(stream)
    assert (first.step, first.total_steps, first.epoch, first.loss) == (1, 10, 0.5, 1.0)
    assert (last.step, last.epoch, last.loss) == (10, 5.0, 0.1)
    assert last.samples_per_s is not None and last.samples_per_s > 0


def test_a_flush_reports_the_last_step_recorded_once() -> None:
    # A job whose code fails ends at its last applied step, which the rate limit may have kept
    # back (the page once said step 94, the manifest 99).
    stream = io.StringIO()
    reporter = ProgressReporter(
        EventWriter(CONFIG, stream), total_steps=300, batch_size=4, samples_per_epoch=8, every_s=3600
    )
    for step in range(94, 100):
        reporter.step_done(step, 0.5, 4)
    assert reporter.flush() and not reporter.flush()
    assert [event.step for event in _events(stream)] == [94, 99]
    assert _events(stream)[-1].samples_per_s is not None
