"""A job's curve over the API: the whole run in at most `points` points (a 20,000-step run
comes back from its first step to its last, bucketed, each bucket's loss envelope kept), and a
restart that went back to the checkpoint comes back as a marked rollback with the run cut into
segments whose steps only move forward."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.models import Job, JobMetric, ResizeEvent
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

START = timezone.now() - timedelta(hours=3)


@pytest.fixture
def job(users: dict[str, Any]) -> Job:
    return Job.objects.create(
        owner=users["alice"], name="long", workload="digits-mlp", spec=VALID_SPEC, min_workers=1,
        max_workers=2, priority="guaranteed", consistency="strict", total_steps=50_000, generation=1,
    )


def add_rows(job: Job, generation: int, steps: range, loss: Any = lambda step: 1.0 / step) -> None:
    JobMetric.objects.bulk_create(
        (JobMetric(job=job, generation=generation, step=step, loss=loss(step), samples_per_s=100.0,
                   metrics={"accuracy": step / 50_000}, at=START + timedelta(seconds=step))
         for step in steps),
        batch_size=5000,
    )


def curve(api: dict, job: Job, **params: Any) -> dict[str, Any]:
    reply = api["alice"].get(f"/api/jobs/{job.pk}/metrics", **params)
    assert reply.status_code == 200, reply.content
    return dict(reply.json())


def test_a_long_run_comes_back_whole_in_at_most_the_points_asked(api: dict, job: Job) -> None:
    add_rows(job, 1, range(1, 20_001), loss=lambda step: 9.0 if step == 12_345 else 1.0 / step)
    default = curve(api, job)
    steps = [p["step"] for p in default["points"]]
    assert default["rows"] == 20_000 and default["rollbacks"] == []
    assert 1000 < len(steps) <= 2000, len(steps)
    assert steps[0] == 1 and steps[-1] == 20_000, "the first and the last step are kept"
    assert steps == sorted(set(steps))
    assert sum(p["rows"] for p in default["points"]) >= 20_000 - 1, "every row is stood for by a point"
    spike = next(p for p in default["points"] if p["step"] >= 12_345)
    assert spike["loss_max"] == 9.0 and spike["rows"] > 1, "a bucket keeps its loss envelope"
    assert default["points"][0]["loss"] == 1.0 and default["points"][-1]["loss"] == 1 / 20_000

    few = curve(api, job, points=100)["points"]
    assert len(few) <= 100 and few[0]["step"] == 1 and few[-1]["step"] == 20_000
    assert len(curve(api, job, points=5000)["points"]) <= 5000
    for refused in (1, 5001):
        assert api["alice"].get(f"/api/jobs/{job.pk}/metrics", points=refused).status_code == 400


def test_a_short_run_comes_back_row_for_row(api: dict, job: Job) -> None:
    add_rows(job, 1, range(1, 301))
    points = curve(api, job)["points"]
    assert [p["step"] for p in points] == list(range(1, 301))
    assert all(p["rows"] == 1 and p["loss_min"] == p["loss"] == p["loss_max"] for p in points)
    assert points[10]["metrics"] == {"accuracy": 11 / 50_000}


def test_a_restart_from_the_checkpoint_is_a_marked_rollback(api: dict, job: Job) -> None:
    add_rows(job, 1, range(1, 772))
    # Every worker died at step 771: generation 2 resumed from the checkpoint of step 25, and
    # a later in-place resize (generation 3) went on from where generation 2 was.
    ResizeEvent.objects.create(job=job, generation=2, reason="worker_exited", workers_before=2,
                               workers_after=2, step=25)
    add_rows(job, 2, range(26, 901))
    add_rows(job, 3, range(901, 1201))
    answer = curve(api, job)
    [rollback] = answer["rollbacks"]
    assert {k: rollback[k] for k in ("generation", "at_step_from", "to_step")} == {
        "generation": 2, "at_step_from": 771, "to_step": 25,
    }
    points = answer["points"]
    first = [p for p in points if p["segment"] == 0]
    second = [p for p in points if p["segment"] == 1]
    assert len(first) + len(second) == len(points) == 771 + 875 + 300
    assert [p["step"] for p in first] == list(range(1, 772))
    assert [p["step"] for p in second] == list(range(26, 1201)), "x only moves forward in a segment"
    assert {p["generation"] for p in second} == {2, 3}


def test_a_rollback_without_its_resize_event_and_downsampled(api: dict, job: Job) -> None:
    add_rows(job, 1, range(1, 15_001))
    add_rows(job, 2, range(1, 12_001))  # no checkpoint: back to step 0
    answer = curve(api, job, points=600)
    [rollback] = answer["rollbacks"]
    assert (rollback["at_step_from"], rollback["to_step"]) == (15_000, 0)
    points = answer["points"]
    assert len(points) <= 600
    for segment, last in ((0, 15_000), (1, 12_000)):
        steps = [p["step"] for p in points if p["segment"] == segment]
        assert steps[0] == 1 and steps[-1] == last and steps == sorted(set(steps))


def test_another_users_curve_is_refused(api: dict, job: Job) -> None:
    add_rows(job, 1, range(1, 11))
    assert api["bob"].get(f"/api/jobs/{job.pk}/metrics").status_code == 403
