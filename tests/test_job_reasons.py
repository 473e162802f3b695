"""Why a job ended, in the lists: the list API, the jobs page, `bungee list` and `bungee status`
without a job give a failed or cancelled job's reason, short (its message's first sentence, without
which worker it happened on), to whoever may manage the job (its owner, staff); not to others."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from django.test import Client
from typer.testing import CliRunner

from bungee_cli import main as cli
from portal.jobs.models import REASON_CHARS, Job
from tests.test_cli_submit import sent  # noqa: F401 - the fixture: the CLI's requests answered in process
from tests.test_scheduler_cycle import event, report, submit, training_on_two

pytestmark = pytest.mark.django_db
FAILED_BECAUSE = "the job's code failed: loss(model, batch) raised ValueError: the batch is empty"


def failed_job(api: dict, cluster: Any) -> Job:
    job = training_on_two(api, cluster)
    report(
        cluster,
        event(job, "log", rank=1, message="the job's code failed: loss(model, batch) raised ValueError: the batch "
                                          "is empty\nTraceback (most recent call last):\n  File \"task.py\"..."),
        event(job, "exited", rank=1, exit_code=77, reason="user_error", device_index=1, user_error={
            "error": "loss(model, batch) raised ValueError: the batch is empty",
            "traceback": "Traceback (most recent call last):\n  File \"task.py\"..."}),
    )
    job.refresh_from_db()
    assert job.state == "failed" and "worker rank 1" in job.message
    return job


def reasons(client: Any) -> dict[int, str]:
    return {row["id"]: row["reason"] for row in client.get("/api/jobs").json()}


def test_the_list_api_gives_the_owner_and_staff_why_a_job_ended(api: dict, cluster: Any) -> None:
    failed = failed_job(api, cluster)
    cancelled = submit(api)
    assert api["alice"].post(f"/api/jobs/{cancelled.pk}/cancel").status_code == 200
    running = submit(api)
    for viewer in ("alice", "staff"):
        assert reasons(api[viewer]) == {failed.pk: FAILED_BECAUSE, cancelled.pk: "cancelled by its owner", running.pk: ""}
    assert set(reasons(api["bob"]).values()) == {""}, "another user's job: no reason"
    assert api["alice"].get(f"/api/jobs/{failed.pk}").json()["reason"] == FAILED_BECAUSE


def test_a_long_reason_is_cut(api: dict, cluster: Any) -> None:
    job = failed_job(api, cluster)
    job.message = "x" * 500 + ". And more."
    assert len(job.ended_reason()) == REASON_CHARS and job.ended_reason().endswith("…")


def test_the_jobs_page_shows_the_reason_to_the_owner(api: dict, cluster: Any, users: dict) -> None:
    failed_job(api, cluster)
    for user, shown in (("alice", True), ("bob", False)):
        browser = Client()
        browser.force_login(users[user])
        page = browser.get("/jobs/").content.decode()
        assert (FAILED_BECAUSE.replace("'", "&#x27;") in page) is shown, user


def test_bungee_list_and_status_without_a_job_say_why(
    sent: list[httpx.Request], api: dict, cluster: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(cli.out, "width", 400)  # a wide terminal: each row on one line
    job = failed_job(api, cluster)
    for command in (["list"], ["status"]):
        done = CliRunner().invoke(cli.app, command, terminal_width=400)
        assert done.exit_code == 0, (done.output, done.exception)
        [row] = [line for line in done.output.splitlines() if line.split() and line.split()[0] == str(job.pk)]
        assert FAILED_BECAUSE in row, done.output
    shown = CliRunner().invoke(cli.app, ["status", str(job.pk)], terminal_width=400).output
    assert f"reason              {FAILED_BECAUSE}" in shown, shown
