"""`manage.py prunehistory` and the beat run one implementation (portal.jobs.history): the
command with --dry-run says what it would delete and deletes nothing, without it deletes that;
the beat schedules the task every hour, and the task prunes."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from portal.jobs.models import Job, JobLog
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


@pytest.fixture
def ended_job(users: dict[str, Any], settings: Any) -> Job:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"log_retention_days": 30.0, "log_lines_kept": 5})
    job = Job.objects.create(
        owner=users["alice"], name="ended", workload="digits-mlp", spec=VALID_SPEC, min_workers=1, max_workers=2,
        priority="guaranteed", consistency="strict", total_steps=50, state="succeeded",
        finished_at=timezone.now() - timedelta(days=40),
    )
    JobLog.objects.bulk_create(JobLog(job=job, generation=1, rank=0, at=timezone.now(), line=str(i)) for i in range(12))
    return job


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("prunehistory", *args, stdout=out)
    return out.getvalue()


def test_the_command_says_what_it_would_delete_then_deletes_it(ended_job: Job) -> None:
    said = run("--dry-run")
    assert "logs: 7 lines of 1 ended jobs would be deleted" in said, said
    assert ended_job.logs.count() == 12
    said = run()
    assert "logs: 7 lines of 1 ended jobs were deleted" in said and "metrics: 0 rows" in said, said
    assert ended_job.logs.count() == 5


def test_the_beat_prunes_history_every_hour(ended_job: Job) -> None:
    from portal.celery import app
    from portal.jobs.tasks import prune_history

    app.finalize()
    [entry] = [e for e in app.conf.beat_schedule.values() if e["task"] == "portal.jobs.tasks.prune_history"]
    assert entry["schedule"] == 3600.0
    assert prune_history.delay().get()["log_lines"] == 7
    assert ended_job.logs.count() == 5
