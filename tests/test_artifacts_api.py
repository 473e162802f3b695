"""A job's artifacts through the API: an agent hands them over only for a job that ran on its
node, and only as the manifest describes them; they are kept under the portal's data directory,
downloadable by the job's owner and staff only, shown with the job, and deleted after the
retention period."""

from __future__ import annotations

import hashlib
import io
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from elastic.wire import AgentReport, WorkerEvent
from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from portal.jobs import artifacts
from portal.jobs.agents import ingest_report
from portal.jobs.models import Job, JobArtifacts
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def artifact_dir(settings: Any, tmp_path: Path) -> Path:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    return tmp_path / "artifacts"


@pytest.fixture
def ran_here(api: dict, tokens: dict, cluster: Any) -> Job:
    """Alice's job, whose rank 0 started on node-a; node-a is served by tokens["agent"]."""
    Node.objects.filter(pk=cluster.pk).update(agent_token=ApiToken.lookup(tokens["agent"]))
    job = Job.objects.get(pk=api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])
    run_cycle()
    job.refresh_from_db()
    started = WorkerEvent(job_id=job.pk, generation=job.generation, rank=0, kind="started", at=time.time(),
                          pid=4242, device_index=0)
    ingest_report(cluster, AgentReport(node="node-a", events=[started]))
    return job


def bundle(job_id: int, model: bytes = b"weights", checkpoint: bytes = b"state", **manifest: Any) -> dict[str, bytes]:
    files = {"model.pt": model, "checkpoint.pt": checkpoint}
    described = {
        "job_id": job_id, "ended": "completed", "step": 50,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        "final": {"loss": 0.25, "metrics": {"accuracy": 0.9}}, "bungee_version": "0.1.0", **manifest,
    }
    return {**files, "manifest.json": json.dumps(described).encode()}


def hand_over(tokens: dict, job_id: int, files: dict[str, bytes], token: str = "agent") -> Any:
    return Client().post(
        f"/api/agent/jobs/{job_id}/artifacts",
        {name: SimpleUploadedFile(name, data) for name, data in files.items()},
        HTTP_AUTHORIZATION=f"Bearer {tokens[token]}",
    )


def get(tokens: dict, user: str, path: str) -> Any:
    return Client().get(path, HTTP_AUTHORIZATION=f"Bearer {tokens[user]}")


def test_kept_and_downloadable_by_the_owner_and_staff_only(tokens: dict, ran_here: Job, artifact_dir: Path) -> None:
    job_id = ran_here.pk
    assert get(tokens, "alice", f"/api/jobs/{job_id}/artifacts").status_code == 404
    files = bundle(job_id, model=bytes(range(256)) * 10)
    reply = hand_over(tokens, job_id, files)
    assert reply.status_code == 200, reply.content
    assert (artifact_dir / f"job-{job_id}" / "model.pt").read_bytes() == files["model.pt"]
    listed = get(tokens, "alice", f"/api/jobs/{job_id}/artifacts").json()
    assert listed["step"] == 50 and listed["final"]["metrics"] == {"accuracy": 0.9}
    assert {f["name"] for f in listed["files"]} == {"model.pt", "checkpoint.pt", "manifest.json"}
    assert get(tokens, "alice", f"/api/jobs/{job_id}").json()["artifacts"]["step"] == 50
    for user, status in (("alice", 200), ("staff", 200), ("bob", 403)):
        reply = get(tokens, user, f"/api/jobs/{job_id}/artifacts/model.pt")
        assert reply.status_code == status, user
        if status == 200:
            assert b"".join(reply.streaming_content) == files["model.pt"]
    assert get(tokens, "bob", f"/api/jobs/{job_id}/artifacts").status_code == 403
    assert get(tokens, "alice", f"/api/jobs/{job_id}/artifacts/secrets.txt").status_code == 404
    assert get(tokens, "alice", f"/api/jobs/{job_id}/artifacts/..%2F..%2Fetc%2Fpasswd").status_code == 404


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"drop": "checkpoint.pt"}, "checkpoint.pt"),
        ({"model.pt": b"tampered"}, "model.pt"),
        ({"manifest.json": b"not json"}, "manifest.json"),
        ({"manifest_job": 999}, "manifest.json.job_id"),
    ],
)
def test_what_the_manifest_does_not_describe_is_refused(
    tokens: dict, ran_here: Job, artifact_dir: Path, change: dict, field: str
) -> None:
    files = bundle(change.get("manifest_job", ran_here.pk))
    files.pop(change.get("drop", ""), None)
    files.update({name: data for name, data in change.items() if name.endswith((".pt", ".json"))})
    reply = hand_over(tokens, ran_here.pk, files)
    assert reply.status_code == 400, reply.content
    assert reply.json()["error"]["fields"][0]["field"] == field
    assert not JobArtifacts.objects.exists() and not (artifact_dir / f"job-{ran_here.pk}").exists()


def test_only_the_agent_of_a_node_the_job_ran_on_may_hand_them_over(
    tokens: dict, ran_here: Job, users: dict
) -> None:
    other = ApiToken.issue(users["staff"], "other agent", ApiToken.Role.AGENT)[1]
    tokens = {**tokens, "other": other}
    Client().post(
        "/api/agent/register",
        json.dumps({"name": "node-z", "address": "127.0.0.2", "backend": "simulated", "devices": []}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {other}",
    )
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk), token="other").status_code == 403
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk), token="alice").status_code == 403
    assert not JobArtifacts.objects.exists()


def test_deleted_after_the_retention_period(tokens: dict, ran_here: Job, settings: Any, artifact_dir: Path) -> None:
    hand_over(tokens, ran_here.pk, bundle(ran_here.pk))
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"artifact_retention_days": 30})
    Job.objects.filter(pk=ran_here.pk).update(finished_at=timezone.now() - timedelta(days=29))
    assert artifacts.prune() == []
    Job.objects.filter(pk=ran_here.pk).update(finished_at=timezone.now() - timedelta(days=31))
    assert artifacts.prune() == [ran_here.pk]
    assert not JobArtifacts.objects.exists() and not (artifact_dir / f"job-{ran_here.pk}").exists()
    assert get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts").status_code == 404


def test_a_torch_state_dict_round_trips(tokens: dict, ran_here: Job) -> None:
    import torch

    buffer = io.BytesIO()
    state = {"weight": torch.arange(6.0).reshape(2, 3)}
    torch.save(state, buffer)
    hand_over(tokens, ran_here.pk, bundle(ran_here.pk, model=buffer.getvalue()))
    reply = get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts/model.pt")
    loaded = torch.load(io.BytesIO(b"".join(reply.streaming_content)), weights_only=True)
    assert torch.equal(loaded["weight"], state["weight"])


def test_a_job_starts_from_a_kept_model_of_its_owner_only(tokens: dict, ran_here: Job, api: dict, users: dict) -> None:
    """init_from: the owner (or staff) names a job whose final model is kept; the agent of a
    node the new job runs on fetches that model, with its digest, and no other agent may."""
    source = ran_here.pk
    unkept = api["alice"].post("/api/jobs", {**VALID_SPEC, "init_from": source})
    assert unkept.status_code == 400 and unkept.json()["error"]["fields"][0]["field"] == "init_from", unkept.json()
    files = bundle(source, model=b"the final weights")
    assert hand_over(tokens, source, files).status_code == 200
    for user, status in (("bob", 400), ("staff", 201), ("alice", 201)):
        reply = api[user].post("/api/jobs", {**VALID_SPEC, "init_from": source})
        assert reply.status_code == status, (user, reply.json())
    refused = api["bob"].post("/api/jobs", {**VALID_SPEC, "init_from": source}).json()
    assert refused["error"]["fields"] == [{"field": "init_from", "message": f"no job {source} of yours has a final model to "
                                  "start from", "value": source}]
    assert api["alice"].post("/api/jobs", {**VALID_SPEC, "init_from": 10**6}).status_code == 400

    tuned = Job.objects.get(pk=reply.json()["id"])
    path = f"/api/agent/jobs/{tuned.pk}/initial-model"
    assert get(tokens, "agent", path).status_code == 403, "not placed on the agent's node yet"
    run_cycle()
    fetched = get(tokens, "agent", path)
    assert fetched.status_code == 200, fetched.content
    assert b"".join(fetched.streaming_content) == files["model.pt"]
    assert fetched["X-Bungee-Sha256"] == hashlib.sha256(files["model.pt"]).hexdigest()
    other = ApiToken.issue(users["staff"], "other agent", ApiToken.Role.AGENT)[1]
    Client().post(
        "/api/agent/register",
        json.dumps({"name": "node-z", "address": "127.0.0.2", "backend": "simulated", "devices": []}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {other}",
    )
    assert get({"other": other}, "other", path).status_code == 403
    assert get(tokens, "alice", path).status_code in (401, 403)


def test_a_failed_job_says_the_step_its_artifacts_hold_everywhere(tokens: dict, ran_here: Job, cluster: Any) -> None:
    # Progress reports come every few seconds: the last was at step 94, the code failed in step
    # 100 and rank 0 exported the state after step 99 (the page once said 94, the manifest 99).
    def event(kind: str, **fields: Any) -> WorkerEvent:
        return WorkerEvent(job_id=ran_here.pk, generation=ran_here.generation, rank=0, kind=kind, at=time.time(),
                           **fields)

    progress = event("progress", step=94, total_steps=300, loss=0.5, samples_per_s=100.0, global_batch=32)
    failed = event("exited", reason="user_error", exit_code=77, device_index=0)
    ingest_report(cluster, AgentReport(node="node-a", events=[progress, failed]))
    ran_here.refresh_from_db()
    assert ran_here.state == "failed" and ran_here.steps_done == 94
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk, ended="failed", step=99)).status_code == 200
    shown = get(tokens, "alice", f"/api/jobs/{ran_here.pk}").json()
    listed = next(job for job in get(tokens, "alice", "/api/jobs").json() if job["id"] == ran_here.pk)
    assert (shown["steps_done"], listed["steps_done"], shown["artifacts"]["step"]) == (99, 99, 99)


def test_a_job_reported_ended_before_its_artifacts_arrive_says_they_may_be_on_their_way(
    tokens: dict, ran_here: Job, cluster: Any
) -> None:
    # Rank 0's agent uploads the files in a thread of its own once the events before them are
    # reported; rank 0's exit can reach the portal first, so a succeeded job has none for a moment.
    def artifacts_error() -> str:
        reply = get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts")
        assert reply.status_code == 404, reply.content
        return str(reply.json()["error"]["message"])

    assert "(it is running: a job has them once it has ended)" in artifacts_error()
    completed = WorkerEvent(job_id=ran_here.pk, generation=ran_here.generation, rank=0, kind="exited",
                            at=time.time(), reason="completed", exit_code=0, device_index=0)
    ingest_report(cluster, AgentReport(node="node-a", events=[completed]))
    ran_here.refresh_from_db()
    assert ran_here.state == "succeeded"
    said = artifacts_error()
    assert f"the artifacts of job {ran_here.pk} (it succeeded; " in said and "they may be on their way" in said, said
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk)).status_code == 200
    assert get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts").json()["step"] == 50
