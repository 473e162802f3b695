"""A running job's finish estimate (portal.jobs.eta): a window over its progress, so that swings in
its throughput from one report to the next barely move it; none until the window holds enough
training; and one value for the board, the job's page, the list and the live messages."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portal.jobs import board, eta
from portal.jobs.models import Job
from portal.live import broadcast
from tests.test_scheduler_cycle import event, report
from tests.test_scheduler_reasons import settle, submit

TOTAL_STEPS = 2400


def swinging_history() -> list[tuple[float, int, float]]:
    """(time, steps done, throughput of the stretch) every 5 s: a minute at 1 step/s, a minute at
    3, and so on (2 on average), with a 20 s pause at 10 min (a resize); 1220 s in all."""
    history, at, step = [], 0.0, 0
    while step < TOTAL_STEPS:
        seconds, steps_per_s = (20.0, 0.0) if 600 <= at < 620 else (5.0, 1.0 if int(at // 60) % 2 == 0 else 3.0)
        at, step = at + seconds, min(TOTAL_STEPS, step + int(steps_per_s * seconds))
        history.append((at, step, steps_per_s))
    return history


def test_swings_in_throughput_barely_move_the_estimate() -> None:
    history = swinging_history()
    finished_at = history[-1][0]
    rate, previous, estimates = eta.StepRate(), (0.0, 0), []
    for at, step, steps_per_s in history[:-1]:
        rate = rate.after(step - previous[1], at - previous[0])
        previous = (at, step)
        estimates.append((at, eta.finish_estimate_at(rate, TOTAL_STEPS - step, at), at + (TOTAL_STEPS - step) / (steps_per_s or 1e-9)))
    assert all(estimate is None for at, estimate, _ in estimates if at < eta.STABLE_AFTER_S), "shown only once stable"
    assert all(estimate is not None for at, estimate, _ in estimates if at >= 2 * eta.STABLE_AFTER_S)
    settled = [(estimate, last_sample) for at, estimate, last_sample in estimates if at >= 2 * eta.RATE_WINDOW_S]
    assert all(abs(estimate - finished_at) <= 0.2 * finished_at for estimate, _ in settled), (finished_at, settled)
    # The last report's throughput alone (what the estimate was) strays far further.
    assert max(abs(last - finished_at) for _, last in settled) > 0.5 * finished_at


def test_a_stall_or_a_gap_or_a_step_back() -> None:
    rate = eta.StepRate().after(60, 30.0)
    assert rate.steps_per_s == pytest.approx(2.0)
    assert rate.after(-40, 5.0) == rate, "a restart from a checkpoint is no training"
    assert rate.after(10, eta.GAP_S + 1) == rate, "a stretch in the queue is no training"
    assert rate.after(0, 10.0).steps_per_s < 2.0, "a stall counts"


def test_the_board_the_page_the_list_and_the_live_messages_show_one_estimate(
    api: dict, cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit(api, steps=1000)
    settle(cluster)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(broadcast, "send", lambda group, message: sent.append(message))
    job = Job.objects.get(pk=job_id)
    now = time.time()
    # 20 steps a second in the last report, 5 before it: 10 on average over the 40 s.
    for ago, step in ((40, 100), (20, 400), (0, 500)):
        progress = event(job, "progress", step=step, loss=1.0, samples_per_s=step * 3.2, global_batch=32)
        report(cluster, progress.model_copy(update={"at": now - ago}))
    job.refresh_from_db()
    expected = job.finish_estimate_at()
    assert expected is not None and expected - job.last_progress_at.timestamp() == pytest.approx(500 / 10, rel=0.05)
    page = api["alice"].get(f"/api/jobs/{job_id}").json()["finish_estimate_at"]
    listed = next(row for row in api["alice"].get("/api/jobs").json() if row["id"] == job_id)["finish_estimate_at"]
    on_board = next(row for row in board.active_jobs() if row["id"] == job_id)["finish_estimate_at"]
    live = {message["type"]: message["finish_estimate_at"] for message in sent if "finish_estimate_at" in message}
    assert (page, listed, on_board, live) == (expected,) * 3 + ({"progress": expected, "job_progress": expected},)
