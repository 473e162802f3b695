"""The Bungee portal: the Django project that takes jobs, runs the scheduler through Celery and
streams the cluster to browsers over Channels."""

from portal.celery import app as celery_app

__all__ = ["celery_app"]
