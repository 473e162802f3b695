"""The Celery application: the scheduler and the dispatch of agent commands run here."""

from __future__ import annotations

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("bungee")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["portal.scheduling", "portal.jobs"])


@app.on_after_finalize.connect
def _beat_schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.BUNGEE["SCHEDULE_TICK_S"], sender.signature("portal.scheduling.tasks.tick"),
        name="scheduler tick",
    )
    from portal.jobs.tasks import PRUNE_EVERY_S

    sender.add_periodic_task(
        PRUNE_EVERY_S, sender.signature("portal.jobs.tasks.prune_artifacts"), name="prune artifacts"
    )
    sender.add_periodic_task(
        PRUNE_EVERY_S, sender.signature("portal.jobs.tasks.prune_history"), name="prune history"
    )


@signals.worker_init.connect
@signals.beat_init.connect
def _check_policy(**_: object) -> None:
    """A policy setting that names no policy stops the worker and beat at start. SystemExit,
    because Celery logs and swallows any Exception a signal handler raises."""
    from django.core.exceptions import ImproperlyConfigured

    from portal.scheduling.policy import configured_policy

    try:
        configured_policy()
    except ImproperlyConfigured as err:
        raise SystemExit(f"bungee: {err}") from None
