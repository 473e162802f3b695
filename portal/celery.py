"""The Celery application: the scheduler and the dispatch of agent commands run here."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("bungee")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["portal.scheduling"])


@app.on_after_finalize.connect
def _beat_schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.BUNGEE["SCHEDULE_TICK_S"], sender.signature("portal.scheduling.tasks.tick"),
        name="scheduler tick",
    )
