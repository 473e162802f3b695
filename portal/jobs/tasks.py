"""The jobs app's periodic work (Celery beat): deleting artifacts past their retention."""

from __future__ import annotations

from celery import shared_task

from portal.jobs import artifacts

PRUNE_EVERY_S = 3600.0


@shared_task(name="portal.jobs.tasks.prune_artifacts", ignore_result=True)
def prune_artifacts() -> list[int]:
    """Deletes the artifacts of jobs that ended more than BUNGEE_ARTIFACT_RETENTION_DAYS ago."""
    return artifacts.prune()
