"""Keeping history bounded (portal.jobs.history, portal.cluster.history): old metrics thinned
to a bounded number of rows a job with the first and last step, every generation's ends, the
rollbacks and each bucket's loss extremes kept; full resolution left alone inside its window;
logs of long-ended jobs cut to their last lines; device samples averaged into coarser buckets,
then deleted. A dry run changes nothing and counts what a run then deletes; a second run at the
same moment deletes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from portal.cluster.models import Device, DeviceSample
from portal.jobs import curves, history
from portal.jobs.models import Job, JobLog, JobMetric, ResizeEvent
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def retention(settings: Any) -> dict[str, Any]:
    settings.BUNGEE = settings.BUNGEE.model_copy(
        update={
            "metrics_full_steps": 1000,
            "metrics_full_days": 1.0,
            "metrics_old_points": 400,
            "log_retention_days": 30.0,
            "log_lines_kept": 10,
            "device_samples_full_hours": 24.0,
            "device_samples_bucket_s": 300,
            "device_samples_keep_days": 2.0,
        }
    )
    return dict(settings.BUNGEE)


def make_job(users: dict[str, Any], name: str = "long", **fields: Any) -> Job:
    job = Job.objects.create(
        owner=users["alice"], name=name, workload="digits-mlp", spec=VALID_SPEC, min_workers=1, max_workers=2,
        priority="guaranteed", consistency="strict", total_steps=50_000, **fields,
    )
    Job.objects.filter(pk=job.pk).update(created_at=NOW - timedelta(days=10))
    return job


def add_rows(job: Job, generation: int, steps: range, at: datetime, loss: Any = lambda step: 1.0 / step) -> None:
    JobMetric.objects.bulk_create(
        (JobMetric(job=job, generation=generation, step=step, loss=loss(step), samples_per_s=100.0,
                   at=at + timedelta(seconds=step)) for step in steps),
        batch_size=5000,
    )


def ids(rows: Any) -> set[int]:
    return set(rows.values_list("id", flat=True))


def test_old_metrics_are_thinned_keeping_what_the_curve_needs(users: dict, retention: dict) -> None:
    job = make_job(users)
    long_ago = NOW - timedelta(days=5)
    add_rows(job, 1, range(1, 12_001), long_ago, loss=lambda step: 50.0 if step == 7777 else 1.0 / step)
    # Every worker gone at step 12,000: generation 2 went back to the checkpoint of step 5,000.
    ResizeEvent.objects.create(job=job, generation=2, reason="worker_exited", workers_before=1, workers_after=1,
                               step=5000)
    add_rows(job, 2, range(5001, 18_001), long_ago)
    add_rows(job, 2, range(18_001, 20_001), NOW - timedelta(hours=1) - timedelta(seconds=18_001))
    recent = ids(job.metrics.filter(at__gte=NOW - timedelta(days=1)))
    newest_steps = ids(job.metrics.filter(step__gt=20_000 - 1000))
    rollbacks_before = curves.find_rollbacks(job, curves.generation_spans(job.metrics.all()))
    before = ids(job.metrics.all())

    dry = history.prune(NOW, dry_run=True)
    assert ids(job.metrics.all()) == before, "a dry run changes nothing"
    pruned = history.prune(NOW)
    assert pruned.metric_rows == dry.metric_rows > 20_000 and pruned.metric_jobs == dry.metric_jobs == 1

    after = job.metrics.all()
    assert recent | newest_steps <= ids(after), "full resolution inside its window"
    old_left = after.exclude(id__in=recent | newest_steps)
    assert old_left.count() <= 400, old_left.count()
    kept = set(old_left.values_list("generation", "step"))
    assert {(1, 1), (1, 12_000), (2, 5001)} <= kept, "the first step and the generations' ends"
    assert (1, 7777) in kept, "a bucket keeps its highest loss"
    assert curves.find_rollbacks(job, curves.generation_spans(after)) == rollbacks_before
    whole = curves.curve(job)
    assert whole.points[0]["step"] == 1 and whole.points[-1]["step"] == 20_000

    again = history.prune(NOW)
    assert again.metric_rows == 0 and ids(job.metrics.all()) == ids(after), "a second run changes nothing"


def test_metrics_inside_the_window_or_few_are_left_alone(users: dict, retention: dict) -> None:
    recent = make_job(users, "recent")
    add_rows(recent, 1, range(1, 5001), NOW - timedelta(hours=20))
    few = make_job(users, "few")
    add_rows(few, 1, range(1, 1401), NOW - timedelta(days=5))  # 400 old rows: no more than allowed
    assert history.prune(NOW).metric_rows == 0
    assert recent.metrics.count() == 5000 and few.metrics.count() == 1400


def test_logs_of_long_ended_jobs_are_cut_to_their_last_lines(users: dict, retention: dict, settings: Any) -> None:
    ended_long_ago = make_job(users, "old", state="succeeded", finished_at=NOW - timedelta(days=31))
    ended_lately = make_job(users, "new", state="succeeded", finished_at=NOW - timedelta(days=29))
    running = make_job(users, "running", state="running")
    for job in (ended_long_ago, ended_lately, running):
        JobLog.objects.bulk_create(
            JobLog(job=job, generation=1, rank=0, at=NOW - timedelta(days=40), line=f"line {i}") for i in range(50)
        )
    assert history.prune(NOW, dry_run=True).log_lines == 40
    assert JobLog.objects.count() == 150
    pruned = history.prune(NOW)
    assert (pruned.log_lines, pruned.log_jobs) == (40, 1)
    assert list(ended_long_ago.logs.order_by("id").values_list("line", flat=True)) == [
        f"line {i}" for i in range(40, 50)
    ]
    assert ended_lately.logs.count() == running.logs.count() == 50
    assert history.prune(NOW).log_lines == 0

    settings.BUNGEE = settings.BUNGEE.model_copy(update={"log_lines_kept": 0})
    assert history.prune(NOW).log_lines == 10 and not ended_long_ago.logs.exists()


def test_device_samples_are_averaged_then_deleted(cluster: Any, retention: dict) -> None:
    device = Device.objects.get(node=cluster, index=0)
    # Every 10 s for three days, utilisation going round 0..29 %, memory 1 kB a percent.
    start = NOW - timedelta(days=3)
    DeviceSample.objects.bulk_create(
        (DeviceSample(device=device, taken_at=start + timedelta(seconds=10 * i), utilization_pct=float(i % 30),
                      memory_used_bytes=1000 * (i % 30), temperature_c=50.0, power_w=None)
         for i in range(3 * 8640)),
        batch_size=5000,
    )
    dry = history.prune(NOW, dry_run=True)
    assert DeviceSample.objects.count() == 3 * 8640 and not DeviceSample.objects.filter(averaged_over_s__gt=0).exists()
    pruned = history.prune(NOW)
    assert (pruned.samples_averaged, pruned.samples_deleted) == (dry.samples_averaged, dry.samples_deleted)
    assert pruned.samples_deleted == 8640, "the day past the two kept is gone"

    assert not DeviceSample.objects.filter(taken_at__lt=NOW - timedelta(days=2)).exists()
    full = DeviceSample.objects.filter(taken_at__gte=NOW - timedelta(hours=24))
    assert full.count() == 8640 and not full.filter(averaged_over_s__gt=0).exists()
    averaged = DeviceSample.objects.filter(taken_at__lt=NOW - timedelta(hours=24))
    assert averaged.count() == 288 and set(averaged.values_list("averaged_over_s", flat=True)) == {300}
    assert pruned.samples_averaged == 8640 - 288
    one = averaged.order_by("taken_at").first()
    assert one is not None and one.utilization_pct == 14.5 and one.memory_used_bytes == 14_500
    assert one.temperature_c == 50.0 and one.power_w is None
    assert int(one.taken_at.timestamp()) % 300 == 0, "a bucket starts at a multiple of its length"

    again = history.prune(NOW)
    assert (again.samples_averaged, again.samples_deleted) == (0, 0)
    assert DeviceSample.objects.count() == 8640 + 288


def test_settings_that_make_no_sense_are_refused_at_start() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from portal.config import PortalSettings, load_settings

    with pytest.raises(ImproperlyConfigured, match="BUNGEE_DEVICE_SAMPLES_BUCKET_S='0'"):
        load_settings(PortalSettings, {"BUNGEE_DEVICE_SAMPLES_BUCKET_S": "0"})
    with pytest.raises(ImproperlyConfigured, match="BUNGEE_METRICS_OLD_POINTS='-1'"):
        load_settings(PortalSettings, {"BUNGEE_METRICS_OLD_POINTS": "-1"})
    with pytest.raises(ImproperlyConfigured, match="BUNGEE_DEVICE_SAMPLES_KEEP_DAYS='-2'"):
        load_settings(PortalSettings, {"BUNGEE_DEVICE_SAMPLES_KEEP_DAYS": "-2"})
