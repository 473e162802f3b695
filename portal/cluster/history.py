"""Keeping the device sample history bounded: samples as taken for DEVICE_SAMPLES_FULL_HOURS,
then one per device per DEVICE_SAMPLES_BUCKET_S (the mean of the samples it replaces), and none
past DEVICE_SAMPLES_KEEP_DAYS. portal.jobs.history runs it with the rest of the history.

A downsampled row says so (`averaged_over_s`), so a run only reads the samples it has not
averaged yet, one bucket at a time: its work follows what arrived since the last run, not the
size of the table. Buckets start at multiples of the bucket length since the epoch, and only a
bucket wholly older than the cutoff is averaged, so a bucket is never averaged twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Avg, Count, Min, QuerySet

from portal.batches import delete_in_batches
from portal.cluster.models import DeviceSample


@dataclass(frozen=True)
class SampleRetention:
    full_hours: float
    bucket_s: int
    keep_days: float
    """0: kept for ever."""

    @classmethod
    def from_settings(cls) -> SampleRetention:
        """The retention the settings give (their bounds, checked at start, rule out a negative
        period or a bucket shorter than a second)."""
        bungee = settings.BUNGEE
        return cls(
            bungee.device_samples_full_hours, bungee.device_samples_bucket_s, bungee.device_samples_keep_days
        )


@dataclass(frozen=True)
class SamplesPruned:
    averaged: int
    """Samples that were (or, in a dry run, would be) folded into their bucket's mean."""
    deleted: int
    """Samples older than the retention, deleted (or that would be)."""


def bucket_start(at: datetime, bucket_s: int) -> datetime:
    seconds = int(at.timestamp()) // bucket_s * bucket_s
    return datetime.fromtimestamp(seconds, tz=UTC)


def prune_samples(now: datetime, retention: SampleRetention, dry_run: bool = False) -> SamplesPruned:
    """Deletes the samples past the retention and averages those past the full-resolution
    window, bucket by bucket (see the module's docstring). In a dry run, changes nothing and
    counts what it would do."""
    raw = DeviceSample.objects.filter(averaged_over_s=0)
    deleted = 0
    if retention.keep_days:
        keep_from = now - timedelta(days=retention.keep_days)
        deleted = delete_in_batches(DeviceSample.objects.filter(taken_at__lt=keep_from), dry_run)
        raw = raw.filter(taken_at__gte=keep_from)
    raw = raw.filter(taken_at__lt=bucket_start(now - timedelta(hours=retention.full_hours), retention.bucket_s))
    averaged = 0
    since: datetime | None = None
    while True:
        pending = raw if since is None else raw.filter(taken_at__gte=since)
        first = pending.order_by("taken_at").values_list("taken_at", flat=True).first()
        if first is None:
            break
        start = bucket_start(first, retention.bucket_s)
        since = start + timedelta(seconds=retention.bucket_s)
        averaged += _average_bucket(raw.filter(taken_at__gte=start, taken_at__lt=since), start, retention, dry_run)
    return SamplesPruned(averaged, deleted)


def _average_bucket(rows: QuerySet[DeviceSample], start: datetime, retention: SampleRetention, dry_run: bool) -> int:
    """Replaces each device's raw samples in one bucket by one row holding their mean; returns
    how many samples that folded away."""
    means = list(
        rows.order_by()
        .values("device_id")
        .annotate(
            samples=Count("id"), keep=Min("id"), utilization=Avg("utilization_pct"),
            memory=Avg("memory_used_bytes"), temperature=Avg("temperature_c"), power=Avg("power_w"),
        )
    )
    if not dry_run:
        DeviceSample.objects.bulk_update(
            [
                DeviceSample(
                    id=m["keep"], taken_at=start, utilization_pct=m["utilization"],
                    memory_used_bytes=round(m["memory"]), temperature_c=m["temperature"], power_w=m["power"],
                    averaged_over_s=retention.bucket_s,
                )
                for m in means
            ],
            ["taken_at", "utilization_pct", "memory_used_bytes", "temperature_c", "power_w", "averaged_over_s"],
            batch_size=500,
        )
        # The kept rows are averaged now, no longer raw: this deletes only the others.
        rows.delete()
    return sum(m["samples"] - 1 for m in means)
