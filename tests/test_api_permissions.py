"""Who may do what: everyone logged in sees every job on the list and the cluster; a job's
details, logs, metrics and actions belong to its owner and staff; tokens have roles."""

from __future__ import annotations

from typing import Any

import pytest

from portal.cluster.models import Node
from portal.jobs.models import Job
from tests.conftest import MODE_FIELDS, VALID_SPEC

pytestmark = pytest.mark.django_db


@pytest.fixture
def alices_job(api: dict, cluster: Any) -> int:
    return int(api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("get", "/api/jobs/{id}", None),
        ("get", "/api/jobs/{id}/logs", None),
        ("get", "/api/jobs/{id}/metrics", None),
        ("get", "/api/jobs/{id}/evaluations", None),
        ("post", "/api/jobs/{id}/resize", {"workers": 1}),
        ("post", "/api/jobs/{id}/unpin", None),
        ("post", "/api/jobs/{id}/cancel", None),
    ],
)
def test_second_user_is_refused(api: dict, alices_job: int, method: str, path: str, body: Any) -> None:
    url = path.format(id=alices_job)
    call = getattr(api["bob"], method)
    reply = call(url, body) if method == "post" else call(url)
    assert reply.status_code == 403, reply.content
    assert "belongs to alice" in reply.json()["error"]["message"]
    job = Job.objects.get(pk=alices_job)
    assert job.state == "queued" and job.pinned_workers is None
    owner_call = getattr(api["alice"], method)
    assert (owner_call(url, body) if method == "post" else owner_call(url)).status_code == 200
    staff_call = getattr(api["staff"], method)
    assert (staff_call(url, body) if method == "post" else staff_call(url)).status_code in {200, 409}


def test_everyone_sees_the_list_and_cluster(api: dict, alices_job: int) -> None:
    assert [j["id"] for j in api["bob"].get("/api/jobs").json()] == [alices_job]
    cluster = api["bob"].get("/api/cluster").json()
    assert [d["index"] for d in cluster["nodes"][0]["devices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("path", ["/api/jobs", "/api/cluster", "/api/workloads"])
def test_anonymous_and_bad_tokens_are_refused(api: dict, path: str) -> None:
    from tests.conftest import ApiClient

    for client in (api["anonymous"], ApiClient("bng_not-a-token")):
        reply = client.get(path)
        assert reply.status_code == 401, (path, reply.content)
        assert reply.json()["error"]["code"] == "unauthenticated"
    reply = api["agent"].get(path)
    assert reply.status_code == 403 and "this token's role is 'agent'" in reply.json()["error"]["message"]


def test_user_token_cannot_act_as_agent(api: dict) -> None:
    """A user token is a valid token, just not one that may speak for a node: 403, not 401."""
    body = {"name": "evil", "address": "1.2.3.4", "backend": "simulated", "devices": []}
    report = {"node": "evil", "samples": [], "events": [], "running": []}
    takes = {"/api/agent/register": "'agent' or 'pool'", "/api/agent/report": "'agent'"}
    for path, payload in (("/api/agent/register", body), ("/api/agent/report", report)):
        for user in ("alice", "staff"):
            reply = api[user].post(path, payload)
            assert reply.status_code == 403, (path, user, reply.content)
            assert reply.json()["error"]["message"] == (
                f"this token's role is 'user'; this endpoint takes a token of role {takes[path]}"
            )
    assert not Node.objects.exists()
    assert api["agent"].post("/api/agent/register", body).status_code == 200


def test_session_needs_csrf_for_writes(users: dict) -> None:
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(users["alice"])
    assert browser.get("/api/jobs").status_code == 200
    refused = browser.post("/api/jobs", VALID_SPEC, content_type="application/json")
    assert refused.status_code in {401, 403}
    browser.get("/login/")
    token = browser.cookies["csrftoken"].value
    accepted = browser.post("/api/jobs", VALID_SPEC, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert accepted.status_code == 201, accepted.content


def test_job_page_permissions(users: dict, api: dict, alices_job: int) -> None:
    from django.test import Client

    bob = Client()
    bob.force_login(users["bob"])
    assert bob.get(f"/jobs/{alices_job}/").status_code == 403
    assert bob.get("/").status_code == 200 and b"mlp" in bob.get("/").content
    alice = Client()
    alice.force_login(users["alice"])
    assert alice.get(f"/jobs/{alices_job}/").status_code == 200
    assert Client().get("/").status_code == 302, "anonymous visitors are sent to the login page"


def test_openapi_document_is_served_and_pinned(api: dict) -> None:
    from django.test import Client

    document = Client().get("/api/openapi.json").json()
    assert set(document["paths"]) == {
        "/api/jobs",
        "/api/jobs/validate",
        "/api/jobs/{job_id}",
        "/api/jobs/{job_id}/resize",
        "/api/jobs/{job_id}/unpin",
        "/api/jobs/{job_id}/cancel",
        "/api/jobs/{job_id}/metrics",
        "/api/jobs/{job_id}/evaluations",
        "/api/jobs/{job_id}/artifacts",
        "/api/jobs/{job_id}/artifacts/{name}",
        "/api/agent/jobs/{job_id}/artifacts",
        "/api/agent/jobs/{job_id}/initial-model",
        "/api/jobs/{job_id}/logs",
        "/api/cluster",
        "/api/cluster/history",
        "/api/devices/{device_id}/samples",
        "/api/nodes",
        "/api/nodes/{name}/drain",
        "/api/workloads",
        "/api/scheduler/decisions/latest",
        "/api/agent/register",
        "/api/agent/report",
        "/api/agent/code/{digest}",
        "/api/code",
        "/api/code/{digest}",
    }
    submit = document["paths"]["/api/jobs"]["post"]
    spec = submit["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"workload", "code", "entrypoint"} <= set(spec)
    # The consistency modes' fields (strict: V; hybrid: the batch bounds and the rate's rules).
    assert {"consistency", *MODE_FIELDS} <= set(spec)
    detail = document["components"]["schemas"]["JobDetailOut"]["properties"]
    assert {"virtual_workers", "global_batch", "learning_rate"} <= set(detail)


def _response_shape(response: dict) -> str | None:
    schema = response.get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return None
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[1]
    if schema.get("type") == "array" and "$ref" in schema.get("items", {}):
        return "list[" + schema["items"]["$ref"].rsplit("/", 1)[1] + "]"
    return schema.get("type")


def test_openapi_response_schemas_are_pinned() -> None:
    """Each operation's success status and body schema, and the one error shape for its 4xx:
    a change to what a client receives shows here. (None: a file, or a body not yet typed.)"""
    from django.test import Client

    document = Client().get("/api/openapi.json").json()
    shapes = {
        f"{method.upper()} {path}": (
            next(int(code) for code in operation["responses"] if str(code).startswith("2")),
            _response_shape(next(r for c, r in operation["responses"].items() if str(c).startswith("2"))),
            operation["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"],
        )
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    error = "#/components/schemas/Error"
    assert shapes == {
        "GET /api/agent/code/{digest}": (200, None, error),
        "GET /api/agent/jobs/{job_id}/initial-model": (200, None, error),
        "GET /api/cluster": (200, None, error),
        "GET /api/cluster/history": (200, None, error),
        "GET /api/code": (200, "array", error),
        "GET /api/code/{digest}": (200, None, error),
        "GET /api/devices/{device_id}/samples": (200, "list[SampleOut]", error),
        "GET /api/nodes": (200, "list[NodeOut]", error),
        "POST /api/nodes/{name}/drain": (200, "NodeOut", error),
        "GET /api/jobs": (200, "list[JobSummaryOut]", error),
        "GET /api/jobs/{job_id}": (200, "JobDetailOut", error),
        "GET /api/jobs/{job_id}/artifacts": (200, None, error),
        "GET /api/jobs/{job_id}/artifacts/{name}": (200, None, error),
        "GET /api/jobs/{job_id}/evaluations": (200, "list[EvaluationOut]", error),
        "GET /api/jobs/{job_id}/logs": (200, "list[LogOut]", error),
        "GET /api/jobs/{job_id}/metrics": (200, "MetricsOut", error),
        "GET /api/scheduler/decisions/latest": (200, None, error),
        "GET /api/workloads": (200, "list[WorkloadOut]", error),
        "POST /api/agent/jobs/{job_id}/artifacts": (200, None, error),
        "POST /api/agent/register": (200, "RegistrationReply", error),
        "POST /api/agent/report": (200, "ReportOut", error),
        "POST /api/code": (201, "object", error),
        "POST /api/jobs": (201, "JobDetailOut", error),
        "POST /api/jobs/validate": (200, "SpecCheckOut", error),
        "POST /api/jobs/{job_id}/cancel": (200, "JobDetailOut", error),
        "POST /api/jobs/{job_id}/resize": (200, "JobDetailOut", error),
        "POST /api/jobs/{job_id}/unpin": (200, "JobDetailOut", error),
    }
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"status", "code", "message", "fields"}
    assert set(schemas["FieldErrorOut"]["properties"]) == {"field", "message", "value"}
    # Bounds the code enforces are in the document, so that a client can know them.
    history = next(p for p in document["paths"]["/api/cluster/history"]["get"]["parameters"] if p["name"] == "minutes")
    assert (history["schema"]["minimum"], history["schema"]["maximum"]) == (1, 1440)
    workers = schemas["ResizeIn"]["properties"]["workers"]["anyOf"][0]
    assert (workers["minimum"], workers["maximum"]) == (1, 1024)
