"""The consistency modes in the portal: the submit form explains both and takes V (strict) or the
batch bounds and rate rules (hybrid), ignoring the other mode's inputs; a bad value is shown next
to its input; the progress a hybrid job reports (global batch, learning rate) reaches the job's
API and page."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from elastic.wire import AgentReport, WorkerEvent
from portal.jobs.agents import ingest_report
from portal.jobs.models import Job
from portal.scheduling.cycle import run_cycle
from tests.conftest import MODE_FIELDS, VALID_SPEC

pytestmark = pytest.mark.django_db

FORM = {
    "name": "modes",
    "workload": "digits-cnn",
    "min_workers": "1",
    "max_workers": "4",
    "priority": "guaranteed",
    "length": "100",
    "length_kind": "steps",
    "seed": "0",
}


def browser(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["alice"])
    return client


def test_the_form_explains_both_modes_and_has_their_fields(users: dict[str, Any]) -> None:
    page = browser(users).get("/jobs/new/").content.decode()
    assert "bit for bit the one a fixed-size run gives" in page
    assert "the global batch grows with the workers" in page
    for name in MODE_FIELDS:
        assert f'name="{name}"' in page, name
    assert 'data-mode="strict"' in page and 'data-mode="hybrid"' in page


def submitted_spec(users: dict[str, Any], **fields: str) -> dict[str, Any]:
    """The spec of the job that the form makes from FORM and `fields`."""
    reply = browser(users).post("/jobs/new/", {**FORM, **fields})
    assert reply.status_code == 302, reply.content.decode()[-2000:]
    return Job.objects.get().spec


def test_a_strict_job_takes_v_and_ignores_the_hybrid_inputs(users: dict[str, Any]) -> None:
    spec = submitted_spec(
        users, consistency="strict", virtual_workers="8", min_batch_size="16", lr_scaling="linear"
    )
    assert spec["virtual_workers"] == 8 and spec["min_batch_size"] is None


def test_the_form_takes_a_precision_for_either_mode(users: dict[str, Any]) -> None:
    page = browser(users).get("/jobs/new/").content.decode()
    assert 'name="precision"' in page and "strict stays bit for bit" in page
    assert submitted_spec(users, consistency="strict", precision="bf16")["precision"] == "bf16"


def test_a_bad_precision_is_shown_next_to_its_input(users: dict[str, Any]) -> None:
    reply = browser(users).post("/jobs/new/", {**FORM, "precision": "fp16"})
    page = reply.content.decode()
    assert reply.status_code == 400 and 'id="precision-error"' in page, page[-2000:]
    assert "Input should be &#x27;fp32&#x27; or &#x27;bf16&#x27;" in page, page[-2000:]


def test_a_hybrid_job_takes_its_batch_bounds_and_rate_rules(users: dict[str, Any]) -> None:
    spec = submitted_spec(
        users,
        consistency="hybrid",
        virtual_workers="8",
        batch_per_worker="8",
        min_batch_size="16",
        max_batch_size="32",
        lr_scaling="sqrt",
        warmup_steps="10",
    )
    assert (spec["batch_per_worker"], spec["min_batch_size"], spec["max_batch_size"]) == (8, 16, 32)
    assert spec["lr_scaling"] == "sqrt" and spec["warmup_steps"] == 10 and spec["virtual_workers"] is None


def test_a_bad_v_is_shown_next_to_its_input_and_kept(users: dict[str, Any]) -> None:
    reply = browser(users).post("/jobs/new/", {**FORM, "consistency": "strict", "virtual_workers": "2"})
    page = reply.content.decode()
    assert reply.status_code == 400 and Job.objects.count() == 0
    assert 'id="virtual_workers-error"' in page and "must be at least max_workers (4)" in page
    assert 'value="2"' in page


def test_hybrid_progress_reaches_the_api_and_the_page(api: dict, users: dict[str, Any], cluster: Any) -> None:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, "consistency": "hybrid"})
    assert reply.status_code == 201, reply.content
    job = Job.objects.get(pk=reply.json()["id"])
    run_cycle()
    job.refresh_from_db()
    progress = WorkerEvent(
        job_id=job.pk,
        generation=job.generation,
        rank=0,
        kind="progress",
        at=time.time(),
        step=7,
        total_steps=50,
        loss=1.5,
        samples_per_s=300.0,
        global_batch=48,
        lr=0.0375,
    )
    ingest_report(cluster, AgentReport(node=cluster.name, events=[progress]))
    detail = api["alice"].get(f"/api/jobs/{job.pk}").json()
    assert (detail["global_batch"], detail["learning_rate"], detail["virtual_workers"]) == (48, 0.0375, None)
    page = browser(users).get(f"/jobs/{job.pk}/")
    assert page.status_code == 200
    strict = api["alice"].post("/api/jobs", {**VALID_SPEC, "name": "strict"}).json()
    assert strict["virtual_workers"] == VALID_SPEC["max_workers"]
