"""The spec's sharding fields through the API: `sharding` defaults to none and is stored; fsdp,
not built end to end yet, is refused with a 400 that names the field and says so; replicas of
shards are refused on their own field, each case with its own message, and nothing is stored."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.spec import JobSpec
from portal.jobs.models import Job
from tests.conftest import VALID_SPEC
from tests.test_bad_input import error_of

pytestmark = pytest.mark.django_db


def test_a_job_is_unsharded_by_default_and_says_so(api: dict) -> None:
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, "sharding": "none", "shard_replicas": 1})
    assert reply.status_code == 201, reply.content[:500]
    job = Job.objects.get()
    assert job.spec["sharding"] == "none" and job.spec["shard_replicas"] == 1
    # A spec stored before the fields existed reads as unsharded.
    older = {k: v for k, v in job.spec.items() if k not in ("sharding", "shard_replicas")}
    assert JobSpec(**older).sharding == "none"


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"sharding": "fsdp"}, {"sharding": "fsdp is not available yet"}),
        ({"sharding": "zero"}, {"sharding": "'none' or 'fsdp'"}),
        ({"shard_replicas": 2}, {"shard_replicas": "only sharded jobs (sharding: fsdp)"}),
        (
            {"sharding": "fsdp", "shard_replicas": 2, "max_workers": 1},
            {"sharding": "fsdp is not available yet", "shard_replicas": "on 2 workers, but max_workers is 1"},
        ),
        (
            {"sharding": "fsdp", "shard_replicas": 2, "max_workers": 2},
            {"sharding": "fsdp is not available yet", "shard_replicas": "2 is not available yet"},
        ),
        ({"shard_replicas": 3}, {"shard_replicas": "less than or equal to 2"}),
    ],
)
def test_sharding_that_is_not_built_or_does_not_fit_is_refused_by_field(
    api: dict, fields: dict[str, Any], refused: dict[str, str]
) -> None:
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, **fields}), 400)
    got = {field["field"]: field["message"] for field in error["fields"]}
    assert set(got) == set(refused), got
    for name, words in refused.items():
        assert words in got[name], (name, got[name])
    assert not Job.objects.exists()


def test_a_worker_never_takes_a_sharded_spec() -> None:
    with pytest.raises(ValueError, match="sharding: fsdp is not available yet"):
        JobSpec(**{**VALID_SPEC, "sharding": "fsdp"})
