"""An agent's manifest is checked against its schema (elastic.artifacts.Manifest) before it is
kept: a wrong type, a missing field or an overlong text is a 400 naming the field, and nothing is
kept. A manifest kept before the check that fails it no longer breaks the job's API: the job's
detail and its artifacts show it as not valid instead of answering 500."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portal.jobs.models import Job, JobArtifacts
from tests import test_artifacts_api
from tests.test_artifacts_api import bundle, get, hand_over

pytestmark = pytest.mark.django_db

ran_here = test_artifacts_api.ran_here
artifact_dir = test_artifacts_api.artifact_dir


TRAINED_WITH = {"python": "3.11.9 (main)", "torch": "2.13.0+cpu", "torch_cuda": None}
OWN = {"digest": "0" * 64, "source": "requirements.txt", "requirements": ["einops==0.8.1"],
       "packages": {"einops": "0.8.1"}, "left_out": 0}


def with_manifest(job_id: int, change: dict[str, Any], drop: str = "") -> dict[str, bytes]:
    files = bundle(job_id, **change)
    manifest = json.loads(files["manifest.json"])
    manifest.pop(drop, None)
    return {**files, "manifest.json": json.dumps(manifest).encode()}


@pytest.mark.parametrize(
    ("change", "drop", "field"),
    [
        ({"final": True}, "", "manifest.json.final"),
        ({}, "step", "manifest.json.step"),
        ({"step": "50"}, "", "manifest.json.step"),
        ({"job_id": True}, "", "manifest.json.job_id"),
        ({"bungee_version": "v" * 100_000}, "", "manifest.json.bungee_version"),
        ({"final": {"loss": "low", "metrics": {}}}, "", "manifest.json.final.loss"),
        ({"files": {"model.pt": "not a digest"}}, "", "manifest.json.files.model.pt"),
        ({"environment": {"torch": "2.13.0"}}, "", "manifest.json.environment.python"),
        ({"environment": {**TRAINED_WITH, "own_packages": {**OWN, "digest": "abc"}}}, "",
         "manifest.json.environment.own_packages.digest"),
        ({"environment": {**TRAINED_WITH, "own_packages": {**OWN, "packages": {f"p{n}": "1" * 200 for n in range(400)}}}},
         "", "manifest.json.environment.own_packages"),
        ({"environment": {**TRAINED_WITH, "own_packages": {**OWN, "requirements": ["x" * 5000]}}}, "",
         "manifest.json.environment.own_packages.requirements.0"),
    ],
    ids=["final true", "no step", "step a string", "job_id true", "huge version", "loss a string", "bad digest",
         "no python", "environment's digest", "too many packages' characters", "overlong requirement"],
)
def test_a_manifest_that_fails_its_schema_is_400_naming_the_field(
    tokens: dict, ran_here: Job, artifact_dir: Path, change: dict, drop: str, field: str
) -> None:
    if "job_id" in change:
        files = bundle(ran_here.pk)
        manifest = {**json.loads(files["manifest.json"]), **change}
        files["manifest.json"] = json.dumps(manifest).encode()
    else:
        files = with_manifest(ran_here.pk, change, drop)
    reply = hand_over(tokens, ran_here.pk, files)
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert error["code"] == "invalid_artifacts" and field in [f["field"] for f in error["fields"]], error
    assert not JobArtifacts.objects.exists() and not (artifact_dir / f"job-{ran_here.pk}").exists()


def test_a_manifest_stored_badly_before_the_check_shows_as_not_valid(
    tokens: dict, ran_here: Job, artifact_dir: Path
) -> None:
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk)).status_code == 200
    JobArtifacts.objects.filter(job=ran_here).update(manifest={"job_id": ran_here.pk, "final": True})
    detail = get(tokens, "alice", f"/api/jobs/{ran_here.pk}")
    assert detail.status_code == 200, detail.content
    shown = detail.json()["artifacts"]
    assert shown["manifest_valid"] is False and shown["final"] is None and shown["step"] == 50
    listed = get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts")
    assert listed.status_code == 200 and listed.json()["manifest"] is None


def test_a_manifest_with_the_environment_is_kept_as_sent(tokens: dict, ran_here: Job) -> None:
    environment = {**TRAINED_WITH, "own_packages": OWN}
    assert hand_over(tokens, ran_here.pk, bundle(ran_here.pk, environment=environment)).status_code == 200
    listed = get(tokens, "alice", f"/api/jobs/{ran_here.pk}/artifacts").json()
    assert listed["manifest"]["environment"] == environment
