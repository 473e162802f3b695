"""Liveness files (elastic.liveness) for the Celery worker and beat, which answer no HTTP: a
Kubernetes exec probe reads the file's age instead of asking them over the broker (`celery
inspect ping` starts Celery and Django in every probe and asks through Redis).

- The worker touches BUNGEE_LIVENESS_FILE (settings.BUNGEE.liveness_file) at start and at each
  of its heartbeats (Celery's `heartbeat_sent`, every 2 s while its event loop turns).
- Beat touches it after each turn of its scheduler loop (`LivenessScheduler.tick`, at least
  every BUNGEE_SCHEDULE_TICK_S). Beat runs with `-S portal.liveness:LivenessScheduler` where a
  probe reads the file (deploy/kubernetes); it is Celery's PersistentScheduler otherwise.

Neither beats while its broker is away: both wait in kombu's reconnection loop, in their main
thread (seen with Celery 5.7). The probes' --max-age is therefore minutes, not seconds, so that
a short Redis outage restarts nothing; past it a restart costs nothing (tasks are acknowledged
late, and beat's schedule is rebuilt from the settings)."""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import signals
from celery.beat import PersistentScheduler
from django.conf import settings

from elastic.liveness import LivenessFile


@cache
def liveness() -> LivenessFile:
    """The process's liveness file, read from the settings at its first use (this module is
    imported with the Celery app, before Django's settings are)."""
    return LivenessFile(settings.BUNGEE.liveness_file)


@signals.worker_init.connect(weak=False)
@signals.beat_init.connect(weak=False)
def _started(**_: object) -> None:
    """A new run: the file an earlier run left in its volume says nothing about this one."""
    liveness().start()


@signals.worker_ready.connect(weak=False)
@signals.heartbeat_sent.connect(weak=False)
def _worker_beat(**_: object) -> None:
    liveness().beat()


class LivenessScheduler(PersistentScheduler):
    """PersistentScheduler that touches the liveness file after every tick."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay: float = super().tick(*args, **kwargs)
        liveness().beat()
        return delay
