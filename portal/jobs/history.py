"""Keeping history bounded: one implementation, run hourly by the beat
(portal.jobs.tasks.prune_history) and by `manage.py prunehistory [--dry-run]`.

- A job's metrics stay as reported for its newest METRICS_FULL_STEPS steps and its last
  METRICS_FULL_DAYS days. Older rows are thinned to buckets of steps across that old part of
  the run (the buckets of portal.jobs.curves, about METRICS_OLD_POINTS / 4 of them): each keeps
  its newest row and the rows of its lowest and highest loss, and every generation keeps its
  first and last row, so the curve's start, its rollbacks (they are read from the generations'
  first and last steps) and ingest's check for replayed reports see what they saw before.
- The logs of jobs that ended more than LOG_RETENTION_DAYS ago are cut to their last
  LOG_LINES_KEPT lines (0: deleted).
- Device samples: portal.cluster.history.
- Pool nodes drained or lost past POOL_NODE_RETENTION_HOURS: portal.cluster.pool_nodes.

Every step works a job, or a few thousand rows, at a time. Running it again at the same moment
changes nothing, and two runs at once do the same work twice, harmlessly."""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Max, Q, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from portal.batches import DELETE_BATCH, delete_in_batches
from portal.cluster.history import SampleRetention, prune_samples
from portal.cluster.pool_nodes import prune_pool_nodes
from portal.jobs import curves
from portal.jobs.models import Job, JobLog, JobMetric

log = logging.getLogger(__name__)

JOB_BATCH = 500


@dataclass(frozen=True)
class Retention:
    metrics_full_steps: int
    metrics_full_days: float
    metrics_old_points: int
    """0: metrics are never thinned."""
    log_retention_days: float
    """0: logs are kept for ever."""
    log_lines_kept: int

    @classmethod
    def from_settings(cls) -> Retention:
        """The retention the settings give (their bounds, checked at start, rule out a negative value)."""
        bungee = settings.BUNGEE
        return cls(
            bungee.metrics_full_steps,
            bungee.metrics_full_days,
            bungee.metrics_old_points,
            bungee.log_retention_days,
            bungee.log_lines_kept,
        )


@dataclass(frozen=True)
class Pruned:
    """What a run deleted (a dry run: would delete)."""

    metric_rows: int
    metric_jobs: int
    log_lines: int
    log_jobs: int
    samples_averaged: int
    samples_deleted: int
    pool_nodes: int
    seconds: float

    def lines(self, dry_run: bool) -> list[str]:
        verb = "would be" if dry_run else "were"
        return [
            f"metrics: {self.metric_rows} rows of {self.metric_jobs} jobs {verb} thinned away",
            f"logs: {self.log_lines} lines of {self.log_jobs} ended jobs {verb} deleted",
            f"device samples: {self.samples_averaged} {verb} averaged into coarser buckets, "
            f"{self.samples_deleted} past the retention {verb} deleted",
            f"pool nodes: {self.pool_nodes} drained or lost past the retention {verb} deleted",
            f"in {self.seconds:.2f} s",
        ]


def prune(now: datetime | None = None, dry_run: bool = False) -> Pruned:
    """Prunes the metrics, logs and device samples as the settings say (see the module's
    docstring); in a dry run, changes nothing and counts. Raises ImproperlyConfigured for a
    setting that makes no sense."""
    began = time.monotonic()
    now = now or timezone.now()
    retention = Retention.from_settings()
    metric_rows, metric_jobs = prune_metrics(now, retention, dry_run)
    log_lines, log_jobs = prune_logs(now, retention, dry_run)
    samples = prune_samples(now, SampleRetention.from_settings(), dry_run)
    pool_nodes = prune_pool_nodes(now, settings.BUNGEE.pool_node_retention_hours, dry_run)
    pruned = Pruned(
        metric_rows, metric_jobs, log_lines, log_jobs, samples.averaged, samples.deleted, pool_nodes,
        time.monotonic() - began,
    )
    if not dry_run:
        log.info("history pruned: %s", "; ".join(pruned.lines(dry_run)))
    return pruned


def _job_ids(jobs: QuerySet[Job]) -> Iterator[int]:
    """The ids of `jobs`, read JOB_BATCH at a time."""
    after = 0
    while batch := list(jobs.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:JOB_BATCH]):
        yield from batch
        after = batch[-1]


def prune_metrics(now: datetime, retention: Retention, dry_run: bool) -> tuple[int, int]:
    """Thins the old metrics of every job that has more than METRICS_OLD_POINTS of them;
    returns the rows deleted and how many jobs had some."""
    if not retention.metrics_old_points:
        return 0, 0
    full_since = now - timedelta(days=retention.metrics_full_days)
    rows = jobs = 0
    for job_id in _job_ids(Job.objects.filter(created_at__lt=full_since)):
        thinned = thin_metrics(Job.objects.get(pk=job_id), full_since, retention, dry_run)
        rows += thinned
        jobs += thinned > 0
    return rows, jobs


def thin_metrics(job: Job, full_since: datetime, retention: Retention, dry_run: bool) -> int:
    """Thins `job`'s metrics older than `full_since` and its newest METRICS_FULL_STEPS steps;
    returns how many rows that deleted (or would)."""
    everything = job.metrics.all()
    if everything.count() <= retention.metrics_old_points:
        return 0
    newest = everything.aggregate(newest=Max("step"))["newest"]
    old = everything.filter(at__lt=full_since, step__lte=newest - retention.metrics_full_steps)
    old_count = old.count()
    if old_count <= retention.metrics_old_points:
        return 0
    rollbacks = curves.find_rollbacks(job, curves.generation_spans(everything))
    ranges = curves.segment_ranges(curves.generation_spans(old), rollbacks)
    # Up to three rows a bucket, and each generation's two ends: a quarter of the points as buckets.
    width = curves.bucket_width(ranges, retention.metrics_old_points // 4)
    first_step, last_step = min(first for first, _ in ranges), max(last for _, last in ranges)
    kept = _kept(curves.bucketed(old, rollbacks, first_step, width))
    if dry_run:
        return old_count - len(kept)
    # Delete by stretches of steps of about DELETE_BATCH rows, sparing the kept rows in each.
    kept_steps = sorted(kept.values())
    kept_ids = sorted(kept, key=kept.__getitem__)
    stretch = max(1, math.ceil((last_step - first_step + 1) * DELETE_BATCH / old_count))
    deleted = 0
    for start in range(first_step, last_step + 1, stretch):
        end = start + stretch
        spared = kept_ids[bisect.bisect_left(kept_steps, start) : bisect.bisect_left(kept_steps, end)]
        deleted += old.filter(step__gte=start, step__lt=end).exclude(id__in=spared).delete()[0]
    return deleted


def _kept(rows: QuerySet[JobMetric]) -> dict[int, int]:
    """Id to step of the rows of `rows` (bucketed) that thinning keeps."""
    bucket = [F("segment"), F("bucket")]
    by_loss = [F("step").asc(), F("id").asc()]
    ranked = rows.annotate(
        newest=Window(RowNumber(), partition_by=bucket, order_by=curves.newest_first()),
        lowest=Window(RowNumber(), partition_by=bucket, order_by=[F("loss").asc(nulls_last=True), *by_loss]),
        highest=Window(RowNumber(), partition_by=bucket, order_by=[F("loss").desc(nulls_last=True), *by_loss]),
        generation_first=Window(RowNumber(), partition_by=[F("generation")], order_by=curves.oldest_first()),
        generation_last=Window(RowNumber(), partition_by=[F("generation")], order_by=curves.newest_first()),
    )
    chosen = ranked.filter(
        Q(newest=1) | Q(lowest=1) | Q(highest=1) | Q(generation_first=1) | Q(generation_last=1)
    )
    return dict(chosen.values_list("id", "step"))


def prune_logs(now: datetime, retention: Retention, dry_run: bool) -> tuple[int, int]:
    """Cuts the logs of jobs that ended more than LOG_RETENTION_DAYS ago to their last
    LOG_LINES_KEPT lines; returns the lines deleted and how many jobs had some."""
    if not retention.log_retention_days:
        return 0, 0
    ended_before = now - timedelta(days=retention.log_retention_days)
    lines = jobs = 0
    for job_id in _job_ids(Job.objects.filter(finished_at__lt=ended_before)):
        doomed = JobLog.objects.filter(job_id=job_id)
        if retention.log_lines_kept:
            oldest_kept = list(
                doomed.order_by("-id").values_list("id", flat=True)[retention.log_lines_kept - 1 : retention.log_lines_kept]
            )
            if not oldest_kept:
                continue
            doomed = doomed.filter(id__lt=oldest_kept[0])
        deleted = delete_in_batches(doomed, dry_run)
        lines += deleted
        jobs += deleted > 0
    return lines, jobs
