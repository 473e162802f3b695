"""Stragglers in the portal, against the real database and Redis: every rank reports its
compute time per step ("step_times" events); a rank well above its peers for the whole window
is migrated to a free device through the normal resize path, and the decision says so."""

from __future__ import annotations

from typing import Any

import pytest

from portal.dispatch import board
from portal.jobs.models import Job, ResizeEvent
from portal.scheduling.cycle import run_cycle
from portal.scheduling.models import SchedulerDecision
from tests.test_scheduler_cycle import event, form, report, submit

pytestmark = pytest.mark.django_db


def step_times(cluster: Any, job: Job, slow_rank: int | None) -> None:
    report(
        cluster,
        *(
            event(job, "step_times", rank=rank, step_times=[0.05 if rank == slow_rank else 0.01] * 20)
            for rank in range(job.allocations.count())
        ),
    )


def test_a_straggler_is_migrated_to_a_free_device(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api, max_workers=2)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    step_times(cluster, job, slow_rank=None)
    assert run_cycle().changed_jobs == [], "no straggler, nothing moves"
    step_times(cluster, job, slow_rank=1)
    assert run_cycle().changed_jobs == [job.pk]
    job.refresh_from_db()
    assert [a.device.index for a in job.allocations.select_related("device").order_by("rank")] == [0, 2]
    assert ResizeEvent.objects.get(job=job, generation=2).reason == "straggler replaced"
    record = board(job.pk).latest()
    assert record is not None and [(m.key, m.joiner) for m in record.members] == [
        ("node-a/0", False),
        ("node-a/2", True),
    ]
    assert "straggler replaced" in job.schedule_reasons
    decision = SchedulerDecision.objects.first()
    assert decision is not None
    [straggler] = decision.stragglers
    assert (straggler["device"], straggler["replacement"], straggler["slowdown"]) == (
        "node-a/1",
        "node-a/2",
        5.0,
    )


def test_too_few_reports_or_a_resize_in_flight_move_nothing(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api, max_workers=2)
    run_cycle()
    job.refresh_from_db()
    report(cluster, event(job, "step_times", rank=1, step_times=[0.05] * 20))
    assert run_cycle().changed_jobs == [], "generation 1 has not formed: its times do not count yet"
    form(cluster, job, 2)
    report(cluster, event(job, "step_times", rank=0, step_times=[0.01] * 5))
    report(cluster, event(job, "step_times", rank=1, step_times=[0.05] * 5))
    assert run_cycle().changed_jobs == [], "fewer steps than the window"
