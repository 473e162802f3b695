"""Asking the scheduler to run: once the current transaction commits, so that it sees the change
that made the request."""

from __future__ import annotations

import logging

from django.db import transaction

log = logging.getLogger(__name__)


def request_schedule(reason: str) -> None:
    from portal.scheduling.tasks import schedule

    def send() -> None:
        try:
            schedule.delay(reason)
        except Exception:  # a broker outage must not fail the request; the beat tick catches up
            log.exception("could not queue the scheduler (%s); the next tick will run it", reason)

    transaction.on_commit(send)
