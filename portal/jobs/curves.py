"""A job's training curve as people look at it: the whole run in a bounded number of points,
cut into segments at its rollbacks.

A rollback is a restart that went back to an earlier step: every worker was gone, so the new
generation resumed from the periodic checkpoint (or from step 0 without one) and trains steps
again that the job had already reported. Its first reported step is then not past the last step
the generation before it reported. A segment is the run of generations between two rollbacks:
inside one, steps only move forward, so it is drawn as one line with x increasing.

Inside a segment the points are buckets of steps, all of one width across the run: a bucket's
point is its newest row, with the lowest and highest loss of the rows it stands for. Every
segment also keeps its first row, so that the curve starts where the run started and each
segment where its rollback left off. portal.jobs.history uses the same buckets to thin what it
keeps of old history."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import (
    Case,
    Count,
    ExpressionWrapper,
    F,
    IntegerField,
    Max,
    Min,
    QuerySet,
    Value,
    When,
    Window,
)
from django.db.models.expressions import Expression
from django.db.models.functions import RowNumber

from portal.jobs.models import Job, JobMetric, ResizeEvent

DEFAULT_POINTS = 2000
MAX_POINTS = 5000
POINT_FIELDS = ("id", "generation", "step", "epoch", "loss", "samples_per_s", "metrics", "at")


@dataclass(frozen=True)
class GenerationSpan:
    """The steps one generation reported: its first and last, when it reported the first, and
    how many rows it has."""

    generation: int
    first_step: int
    last_step: int
    started_at: datetime
    rows: int


@dataclass(frozen=True)
class Rollback:
    """Generation `generation` went back from step `at_step_from` (the last its predecessor
    reported) to step `to_step` (the completed steps it resumed from), at `at`."""

    generation: int
    at_step_from: int
    to_step: int
    at: datetime


@dataclass(frozen=True)
class Curve:
    points: list[dict[str, Any]]
    """In order of segment, then step; each a JobMetric's fields with `loss_min`, `loss_max`
    and `rows` (how many stored rows it stands for)."""
    rollbacks: list[Rollback]
    rows: int
    """How many stored rows the points were drawn from."""


def generation_spans(rows: QuerySet[JobMetric]) -> list[GenerationSpan]:
    """Per generation with rows in `rows` (one job's), in order of generation."""
    spans = (
        rows.order_by()
        .values("generation")
        .annotate(first_step=Min("step"), last_step=Max("step"), started_at=Min("at"), rows=Count("id"))
        .order_by("generation")
    )
    return [GenerationSpan(**span) for span in spans]


def find_rollbacks(job: Job, spans: list[GenerationSpan]) -> list[Rollback]:
    """The rollbacks among the job's generations `spans`. Where it went back to is the step its
    resize event recorded (the checkpoint's); without one, the step before the first it
    reported (rank 0 reports the first step after every restart)."""
    resumed_at = dict(
        ResizeEvent.objects.filter(job=job, generation__in=[s.generation for s in spans], step__isnull=False)
        .values_list("generation", "step")
    )
    found = []
    for before, span in zip(spans, spans[1:], strict=False):
        if span.first_step > before.last_step:
            continue
        to_step = resumed_at.get(span.generation)
        if to_step is None or to_step >= span.first_step:
            to_step = max(span.first_step - 1, 0)
        found.append(Rollback(span.generation, before.last_step, to_step, span.started_at))
    return found


def segment_of(rollbacks: list[Rollback]) -> Expression:
    """SQL: the segment (0, 1, ...) of a row, from its generation."""
    if not rollbacks:
        return Value(0, output_field=IntegerField())
    return Case(
        *[When(generation__lt=r.generation, then=Value(i)) for i, r in enumerate(rollbacks)],
        default=Value(len(rollbacks)),
        output_field=IntegerField(),
    )


def segment_ranges(spans: list[GenerationSpan], rollbacks: list[Rollback]) -> list[tuple[int, int]]:
    """The (first, last) step of each segment that has rows in `spans`."""
    ranges: dict[int, tuple[int, int]] = {}
    for span in spans:
        segment = sum(1 for r in rollbacks if r.generation <= span.generation)
        first, last = ranges.get(segment, (span.first_step, span.last_step))
        ranges[segment] = (min(first, span.first_step), max(last, span.last_step))
    return list(ranges.values())


def bucket_width(ranges: list[tuple[int, int]], buckets: int) -> int:
    """Steps per bucket so that the segments' `ranges` together span at most about `buckets`
    buckets (each segment may add two part-filled ones)."""
    steps = sum(last - first + 1 for first, last in ranges)
    return max(1, math.ceil(steps / max(buckets, 1)))


def bucket_of(first_step: int, width: int) -> Expression:
    """SQL: the bucket of a row's step, counted from `first_step`."""
    return ExpressionWrapper((F("step") - Value(first_step)) / Value(width), output_field=IntegerField())


def bucketed(rows: QuerySet[JobMetric], rollbacks: list[Rollback], first_step: int, width: int) -> QuerySet[JobMetric]:
    """`rows` with their `segment` and `bucket`."""
    return rows.annotate(segment=segment_of(rollbacks), bucket=bucket_of(first_step, width))


def newest_first() -> list[Any]:
    return [F("step").desc(), F("id").desc()]


def oldest_first() -> list[Any]:
    return [F("step").asc(), F("id").asc()]


def curve(job: Job, points: int = DEFAULT_POINTS) -> Curve:
    """The job's whole curve in at most `points` points (see the module's docstring)."""
    spans = generation_spans(job.metrics.all())
    if not spans:
        return Curve([], [], 0)
    rollbacks = find_rollbacks(job, spans)
    ranges = segment_ranges(spans, rollbacks)
    # Per segment: its part-filled end buckets and its first row come on top of the buckets.
    width = bucket_width(ranges, points - 3 * len(ranges))
    rows = bucketed(job.metrics.all(), rollbacks, min(first for first, _ in ranges), width)
    bucket = [F("segment"), F("bucket")]
    newest = rows.annotate(
        rank=Window(RowNumber(), partition_by=bucket, order_by=newest_first()),
        loss_min=Window(Min("loss"), partition_by=bucket),
        loss_max=Window(Max("loss"), partition_by=bucket),
        rows=Window(Count("id"), partition_by=bucket),
    ).filter(rank=1)
    firsts = rows.annotate(rank=Window(RowNumber(), partition_by=[F("segment")], order_by=oldest_first())).filter(
        rank=1
    )
    chosen = {p["id"]: p for p in newest.values(*POINT_FIELDS, "segment", "loss_min", "loss_max", "rows")}
    for first in firsts.values(*POINT_FIELDS, "segment"):
        chosen.setdefault(first["id"], {**first, "loss_min": first["loss"], "loss_max": first["loss"], "rows": 1})
    ordered = sorted(chosen.values(), key=lambda p: (p["segment"], p["step"], p["id"]))
    return Curve(evenly(ordered, points), rollbacks, sum(s.rows for s in spans))


def evenly(items: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` (2 or more) of `items`, evenly spread, the first and last kept: a curve
    of very many segments, or asked for very few points, has more than its buckets."""
    if len(items) <= limit:
        return items
    return [items[round(i * (len(items) - 1) / (limit - 1))] for i in range(limit)]
