"""The restart budget (portal.jobs.restarts) counts the failures of a bad stretch, not of a job's
whole life: a long job whose workers are killed now and then, each time training again before the
next, keeps going however many it meets; failures in a row with no healthy training between
them still fail it, saying which settings gave up."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from portal.jobs.models import Job
from portal.jobs.restarts import RestartBudget
from portal.scheduling.cycle import run_cycle
from tests.test_scheduler_cycle import event, report, submit

BUDGET = RestartBudget(limit=3, window_s=600.0, healthy_s=30.0)


def test_healthy_training_since_the_last_failure_clears_the_count() -> None:
    counted = BUDGET.charge([(1000.0, 10), (1010.0, 10)], at=1060.0, steps_done=40)
    assert counted == [(1060.0, 40)]


def test_a_failure_before_the_job_trained_again_counts_however_late() -> None:
    """Time alone is not health: no step trained since the last failure, the count stands."""
    counted = BUDGET.charge([(1000.0, 10), (1010.0, 10)], at=1300.0, steps_done=10)
    assert counted == [(1000.0, 10), (1010.0, 10), (1300.0, 10)]


def test_steps_in_too_short_a_stretch_do_not_clear_it() -> None:
    counted = BUDGET.charge([(1000.0, 10)], at=1020.0, steps_done=15)
    assert counted == [(1000.0, 10), (1020.0, 15)]


def test_a_failure_older_than_the_window_no_longer_counts() -> None:
    counted = BUDGET.charge([(1000.0, 10), (1500.0, 10)], at=1700.0, steps_done=10)
    assert counted == [(1500.0, 10), (1700.0, 10)]


@given(st.lists(st.tuples(st.floats(0, 100, allow_nan=False), st.integers(0, 3)), min_size=1, max_size=40))
def test_the_count_never_exceeds_the_failures_of_the_window(gaps: list[tuple[float, int]]) -> None:
    counted: list[tuple[float, int]] = []
    at, steps = 0.0, 0
    for gap, trained in gaps:
        at, steps = at + gap, steps + trained
        counted = BUDGET.charge(counted, at, steps)
        assert counted[-1] == (at, steps)
        assert all(at - when <= BUDGET.window_s for when, _ in counted)
        assert [when for when, _ in counted] == sorted(when for when, _ in counted)


@pytest.fixture
def budget(settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(
        update={"max_restarts": 3, "restart_window_s": 600.0, "restart_healthy_s": 30.0}
    )


def fail_once(cluster: Any, job: Job, at: float, trained_to: int | None) -> None:
    """The job's worker starts, trains to step `trained_to` (None: no step) and is killed at `at`;
    the scheduler plans the job again."""
    job.refresh_from_db()
    events = [event(job, "started", pid=5000 + job.generation, device_index=0)]
    if trained_to is not None:
        events.append(event(job, "progress", step=trained_to, loss=1.0, samples_per_s=50.0))
    report(cluster, *events)
    killed = event(job, "exited", exit_code=-9, reason="failed", device_index=0)
    report(cluster, killed.model_copy(update={"at": at}))
    run_cycle()


@pytest.mark.django_db
def test_a_long_job_survives_a_kill_every_minute(api: dict, cluster: Any, budget: None) -> None:
    """Eight kills a minute apart, the job training between them: it runs on (today's main failed
    it at the fourth, "gave up after 3 restarts")."""
    job = submit(api, max_workers=1, steps=10_000)
    run_cycle()
    began = time.time() - 3600
    for kill in range(8):
        fail_once(cluster, job, began + 60 * kill, trained_to=10 * (kill + 1))
        job.refresh_from_db()
        assert job.state in ("running", "resizing"), (kill, job.message)
    assert job.restarts == 8 and len(job.counted_failures) == 1


@pytest.mark.django_db
def test_failures_in_a_row_without_training_fail_the_job(api: dict, cluster: Any, budget: None) -> None:
    job = submit(api, max_workers=1, steps=10_000)
    run_cycle()
    began = time.time() - 3600
    for kill in range(3):
        fail_once(cluster, job, began + 60 * kill, trained_to=None)
        job.refresh_from_db()
        assert job.state in ("running", "resizing"), job.message
    fail_once(cluster, job, began + 180, trained_to=None)
    job.refresh_from_db()
    assert job.state == "failed" and job.restarts == 4
    assert "gave up after 4 worker failures in 180 s" in job.message
    assert "BUNGEE_MAX_RESTARTS=3" in job.message and "BUNGEE_RESTART_HEALTHY_S=30" in job.message
