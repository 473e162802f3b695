"""Submitting jobs through the API: a valid spec is stored queued; every bad value is reported
with its field and value, as a 400, and nothing is stored."""

from __future__ import annotations

from typing import Any

import pytest

from portal.jobs.models import Job
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


def fields_of(reply: Any) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and {"status", "code", "message", "fields"} <= set(body["error"])
    return {f["field"]: f for f in body["error"]["fields"]}


def test_valid_spec_is_stored_queued_with_defaults(api: dict) -> None:
    reply = api["alice"].post("/api/jobs", VALID_SPEC)
    assert reply.status_code == 201, reply.content
    job = reply.json()
    assert job["state"] == "queued" and job["owner"] == "alice" and job["total_steps"] == 50
    assert job["spec"]["hyperparameters"]["batch_size"] == 64, "defaults filled in"
    assert Job.objects.get(pk=job["id"]).spec["workload"] == "digits-mlp"


def test_mode_defaults_are_stored(api: dict) -> None:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, "max_workers": 3})
    assert reply.status_code == 201, reply.content
    assert reply.json()["spec"]["virtual_workers"] == 3 and reply.json()["virtual_workers"] == 3
    hybrid = {**VALID_SPEC, "consistency": "hybrid", "max_workers": 4, "min_batch_size": 32}
    reply = api["alice"].post("/api/jobs", hybrid)
    assert reply.status_code == 201, reply.content
    stored = reply.json()["spec"]
    assert (stored["batch_per_worker"], stored["min_batch_size"], stored["max_batch_size"]) == (16, 32, 64)
    assert stored["lr_scaling"] == "linear" and reply.json()["virtual_workers"] is None


def test_epochs_become_steps(api: dict) -> None:
    spec = {**VALID_SPEC, "steps": None, "epochs": 2, "hyperparameters": {"batch_size": 100}}
    reply = api["alice"].post("/api/jobs", spec)
    assert reply.status_code == 201, reply.content
    assert reply.json()["total_steps"] > 2


def test_yaml_body(api: dict) -> None:
    text = "name: y\nworkload: digits-cnn\nmin_workers: 1\nmax_workers: 3\nsteps: 10\n"
    reply = api["alice"].post("/api/jobs", text, content_type="application/yaml")
    assert reply.status_code == 201, reply.content


@pytest.mark.parametrize(
    "change,field,fragment",
    [
        ({"workload": "resnet-9000"}, "workload", "unknown workload"),
        ({"min_workers": 0}, "min_workers", "greater than or equal to 1"),
        ({"max_workers": "many"}, "max_workers", "valid integer"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers", "must be at least min_workers (3)"),
        ({"steps": None}, "steps", "exactly one of steps and epochs"),
        ({"epochs": 3}, "epochs", "not both"),
        ({"priority": "vip"}, "priority", "guaranteed"),
        ({"consistency": "loose"}, "consistency", "strict"),
        ({"max_workers": 4, "virtual_workers": 2}, "virtual_workers", "must be at least max_workers (4)"),
        ({"min_batch_size": 8}, "min_batch_size", "only hybrid jobs"),
        ({"consistency": "hybrid", "lr_scaling": "cubic"}, "lr_scaling", "'linear' or 'sqrt'"),
        ({"name": ""}, "name", "at least 1 character"),
        ({"colour": "red"}, "colour", "unknown field; the fields are name, workload"),
        ({"max_wokers": 2}, "max_wokers", "unknown field; did you mean max_workers?"),
        ({"hyperparameters": {"lr": -1}}, "hyperparameters.lr", "greater than 0"),
        ({"hyperparameters": {"hidden": "wide"}}, "hyperparameters.hidden", "valid integer"),
        ({"hyperparameters": {"dropout_rate": 0.5}}, "hyperparameters.dropout_rate", "did you mean dropout?"),
    ],
)
def test_bad_value_is_named(api: dict, change: dict, field: str, fragment: str) -> None:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, **change})
    assert reply.status_code == 400, reply.content
    fields = fields_of(reply)
    assert field in fields, fields
    assert fragment in fields[field]["message"], fields[field]
    assert Job.objects.count() == 0


def test_every_bad_field_reported_at_once(api: dict) -> None:
    spec = {**VALID_SPEC, "min_workers": -1, "priority": "x", "hyperparameters": {"lr": 0, "hidden": 0}}
    fields = fields_of(api["alice"].post("/api/jobs", spec))
    assert {"min_workers", "priority", "hyperparameters.lr", "hyperparameters.hidden"} <= set(fields)
    assert fields["min_workers"]["value"] == -1


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", "null", '"spec"'])
def test_malformed_body(api: dict, body: str) -> None:
    reply = api["alice"].post("/api/jobs", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] in {"malformed_body", "invalid_spec"}


def test_existing_jobs_survive_a_bad_submission(api: dict) -> None:
    assert api["alice"].post("/api/jobs", VALID_SPEC).status_code == 201
    assert api["alice"].post("/api/jobs", {**VALID_SPEC, "max_workers": 0}).status_code == 400
    assert Job.objects.count() == 1


def test_resize_validation(api: dict, cluster: Any) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    too_many = api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 3})
    assert too_many.status_code == 400 and fields_of(too_many)["workers"]["value"] == 3
    assert api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": "two"}).status_code == 400
    assert api["alice"].post(f"/api/jobs/{job_id}/resize", {}).status_code == 400
    ok = api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 2})
    assert ok.status_code == 200 and ok.json()["pinned_workers"] == 2
    assert api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": None}).json()["pinned_workers"] is None


def test_resize_beyond_cluster_and_of_ended_job(api: dict, cluster: Any) -> None:
    spec = {**VALID_SPEC, "max_workers": 8}
    job_id = api["alice"].post("/api/jobs", spec).json()["id"]
    reply = api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 6})
    assert reply.status_code == 400 and "only 4 usable devices" in reply.json()["error"]["message"]
    assert api["alice"].post(f"/api/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    again = api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 2})
    assert again.status_code == 409
    assert api["alice"].post(f"/api/jobs/{job_id}/cancel").status_code == 409


def test_unknown_job_is_404(api: dict) -> None:
    reply = api["alice"].get("/api/jobs/999999")
    assert reply.status_code == 404 and "job 999999" in reply.json()["error"]["message"]


def test_list_filters(api: dict) -> None:
    api["alice"].post("/api/jobs", VALID_SPEC)
    api["bob"].post("/api/jobs", {**VALID_SPEC, "name": "bobs"})
    assert {j["owner"] for j in api["alice"].get("/api/jobs").json()} == {"alice", "bob"}
    assert [j["name"] for j in api["alice"].get("/api/jobs", owner="bob").json()] == ["bobs"]
    assert api["alice"].get("/api/jobs", state="running").json() == []
    assert api["alice"].get("/api/jobs", state="sleeping").status_code == 400
    assert api["alice"].get("/api/jobs", owner="nobody").status_code == 400


def test_the_list_comes_a_page_at_a_time_with_no_query_per_row(
    api: dict, cluster: Any, django_assert_max_num_queries: Any
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from portal.jobs.models import Allocation, Job

    ids = [api["alice"].post("/api/jobs", {**VALID_SPEC, "name": f"j{n}"}).json()["id"] for n in range(7)]
    for rank, device in enumerate(cluster.devices.all()[:2]):  # a job holding devices, as the scheduler leaves it
        Allocation.objects.create(job_id=ids[0], device=device, rank=rank, generation=1)
    first = api["alice"].get("/api/jobs", limit=3)
    assert [j["id"] for j in first.json()] == ids[::-1][:3] and first["X-Total-Count"] == "7"
    pages, reply = [first.json()], first
    while "Link" in reply:
        url = reply["Link"].split(">")[0].lstrip("<").removeprefix("http://testserver")
        assert 'rel="next"' in reply["Link"] and "limit=3" in url
        reply = api["alice"].client.get(url, **api["alice"].headers)
        pages.append(reply.json())
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [j["id"] for p in pages for j in p] == ids[::-1], "every job once, newest first"
    filtered = api["alice"].get("/api/jobs", owner="alice", limit=500, before=ids[2])
    assert [j["id"] for j in filtered.json()] == ids[:2][::-1] and filtered["X-Total-Count"] == "7"
    for bad in ({"limit": 0}, {"limit": 501}, {"limit": "many"}, {"before": -1}):
        refused = api["alice"].get("/api/jobs", **bad)
        assert refused.status_code == 400, (bad, refused.content)
        (name, value), = bad.items()
        assert any(f["field"].endswith(name) for f in refused.json()["error"]["fields"]), refused.json()

    def queries(count: int) -> int:
        for n in range(count):
            api["bob"].post("/api/jobs", {**VALID_SPEC, "name": f"more{n}"})
        with CaptureQueriesContext(connection) as captured:
            assert len(api["alice"].get("/api/jobs", limit=500).json()) == Job.objects.count()
        return len(captured)

    assert queries(0) == queries(20), "the list's queries do not grow with its rows"
    assert [j["workers"] for j in api["alice"].get("/api/jobs", owner="alice", limit=500).json()][-1] == 2


def test_a_jobs_row_and_its_worker_count_are_read_at_one_instant(
    api: dict, cluster: Any, django_user_model: Any
) -> None:
    """A summary's generation, state and worker count come from one statement: read in two, a
    generation committed between them showed the old generation with the new count, and the
    backbone test took a resize for landed before it had begun."""
    from portal.jobs.access import job_for
    from portal.jobs.models import Allocation

    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    job = job_for(django_user_model.objects.get(username="alice"), job_id)
    Allocation.objects.create(job_id=job_id, device=cluster.devices.first(), rank=0, generation=1)  # committed "between"
    assert (job.summary()["workers"], job.summary()["generation"]) == (0, 0), "the count is the row's, not later"
    job.refresh_from_db()
    assert job.summary()["workers"] == 1, "a refreshed job counts again"
