"""The jobs app's periodic work (Celery beat): deleting artifacts past their retention, and
keeping the history of metrics, logs and device samples bounded."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery import shared_task

from portal.jobs import artifacts, history


@shared_task(name="portal.jobs.tasks.prune_artifacts", ignore_result=True)
def prune_artifacts() -> list[int]:
    """Deletes the artifacts of jobs that ended more than BUNGEE_ARTIFACT_RETENTION_DAYS ago."""
    return artifacts.prune()


@shared_task(name="portal.jobs.tasks.prune_history", ignore_result=True)
def prune_history() -> dict[str, Any]:
    """Thins old metrics and device samples and cuts old logs (portal.jobs.history); returns
    what it deleted."""
    return asdict(history.prune())
