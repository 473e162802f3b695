"""Asking the scheduler to run, once the current transaction commits, so that it sees the change
that made the request. The task is sent by name: any app may ask without importing the
scheduler (portal apps depend one way: scheduling -> jobs -> cluster)."""

from __future__ import annotations

import logging

from django.db import transaction

from portal.celery import app

log = logging.getLogger(__name__)

SCHEDULE_TASK = "portal.scheduling.tasks.schedule"


def request_schedule(reason: str) -> None:
    def send() -> None:
        try:
            if app.conf.task_always_eager:
                app.tasks[SCHEDULE_TASK].apply(args=[reason])
            else:
                app.send_task(SCHEDULE_TASK, args=[reason])
        except Exception:  # a broker outage must not fail the request; the beat tick catches up
            log.exception("could not queue the scheduler (%s); the next tick will run it", reason)

    transaction.on_commit(send)
