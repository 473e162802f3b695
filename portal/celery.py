"""The Celery application: the scheduler and the dispatch of agent commands run here."""

from __future__ import annotations

import os

from celery import Celery, signals

import portal.liveness  # noqa: F401 - connects the worker's and beat's liveness beats to Celery's signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("bungee")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["portal.scheduling", "portal.jobs", "portal.slurm"])


PRUNE_EVERY_S = 3600.0
"""The period of the beat's pruning tasks (portal.jobs.tasks), given here, not imported from
them: they import the job lifecycle, which imports this module (portal.trigger)."""


@app.on_after_finalize.connect
def _beat_schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.BUNGEE.schedule_tick_s,
        sender.signature("portal.scheduling.tasks.tick"),
        name="scheduler tick",
    )
    sender.add_periodic_task(
        PRUNE_EVERY_S, sender.signature("portal.jobs.tasks.prune_artifacts"), name="prune artifacts"
    )
    sender.add_periodic_task(
        PRUNE_EVERY_S, sender.signature("portal.jobs.tasks.prune_history"), name="prune history"
    )
    if settings.BUNGEE_SLURM.enabled:
        sender.add_periodic_task(
            settings.BUNGEE_SLURM.every_s, sender.signature("portal.slurm.tasks.size_pool"), name="slurm pool"
        )


@signals.worker_init.connect
@signals.beat_init.connect
def _refuse_bad_settings(**_: object) -> None:
    """The worker and beat stop at start on what stops the portal (portal.asgi), with the same
    message: a policy setting that names no policy, Slurm pool settings that cannot work
    (portal.slurm.config), or, with DEBUG off, a SECRET_KEY anyone can read
    (portal.secrets_check), so that a deployment on the public key does not half start.
    SystemExit, because Celery logs and swallows any Exception a signal handler raises."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from portal.scheduling.policy import configured_policy
    from portal.secrets_check import secret_key_problem
    from portal.slurm.config import pool_config

    try:
        configured_policy()
        pool_config()
    except ImproperlyConfigured as err:
        raise SystemExit(f"bungee: {err}") from None
    weak_key = secret_key_problem(settings.SECRET_KEY, settings.DEBUG)
    if weak_key is not None:
        raise SystemExit(f"bungee: {weak_key}")
