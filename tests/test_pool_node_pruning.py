"""Pool nodes that are gone are pruned with the history (portal.cluster.pool_nodes through
`prunehistory`): a node a pool token registered (a Slurm agent job's), drained or lost and
unheard of past BUNGEE_POOL_NODE_RETENTION_HOURS, is deleted with its devices and the agent token
its registration issued, while its jobs' history still names it. A node still within its
retention, one online, and one an operator's agent token registered stay."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.cluster.models import Device, Node
from portal.jobs.models import Job, Worker
from tests.conftest import VALID_SPEC, ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_limits(settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["slurm:100:100"],
                                                         "pool_node_retention_hours": 24.0})


def _registered(client: ApiClient, name: str, state: str, heard_hours_ago: float) -> Node:
    assert client.post("/api/agent/register", registration(name)).status_code == 200
    Node.objects.filter(name=name).update(state=state, last_seen_at=timezone.now() - timedelta(hours=heard_hours_ago))
    return Node.objects.get(name=name)


def test_gone_pool_nodes_past_their_retention_are_deleted_and_their_jobs_still_name_them(
    users: dict[str, Any], tokens: dict[str, str]
) -> None:
    pool = ApiClient(ApiToken.issue(users["staff"], "pool slurm", ApiToken.Role.POOL, pool="slurm")[1])
    drained = _registered(pool, "slurm-gpu07-job11", Node.State.DRAINED, heard_hours_ago=30)
    lost = _registered(pool, "slurm-gpu07-job12", Node.State.LOST, heard_hours_ago=30)
    recent = _registered(pool, "slurm-gpu07-job13", Node.State.DRAINED, heard_hours_ago=2)
    online = _registered(pool, "slurm-gpu07-job14", Node.State.ONLINE, heard_hours_ago=30)
    fixed = _registered(ApiClient(tokens["agent"]), "gpu-01", Node.State.DRAINED, heard_hours_ago=30)
    job = Job.objects.create(owner=users["alice"], name="ran-there", workload="digits-mlp", spec=VALID_SPEC,
                             min_workers=1, max_workers=1, priority="guaranteed", consistency="strict",
                             total_steps=5, state="succeeded", finished_at=timezone.now())
    Worker.objects.create(job=job, generation=1, rank=0, node=drained, device_index=0, state=Worker.State.EXITED,
                          exited_at=timezone.now() - timedelta(hours=30))
    issued = [drained.agent_token_id, lost.agent_token_id]

    out = io.StringIO()
    call_command("prunehistory", "--dry-run", stdout=out)
    assert "pool nodes: 2 drained or lost past the retention would be deleted" in out.getvalue()
    assert Node.objects.count() == 5
    call_command("prunehistory", stdout=io.StringIO())

    assert sorted(Node.objects.values_list("name", flat=True)) == sorted([recent.name, online.name, fixed.name])
    assert not Device.objects.filter(node_id__in=[drained.pk, lost.pk]).exists()
    assert not ApiToken.objects.filter(id__in=issued).exists(), "the agent tokens their registrations issued"
    history = ApiClient(tokens["alice"]).get(f"/api/jobs/{job.pk}").json()["workers_history"]
    assert [row["node"] for row in history] == ["slurm-gpu07-job11"]


def test_a_retention_of_zero_keeps_them_for_ever(users: dict[str, Any], settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_node_retention_hours": 0.0})
    pool = ApiClient(ApiToken.issue(users["staff"], "pool slurm", ApiToken.Role.POOL, pool="slurm")[1])
    _registered(pool, "slurm-gpu07-job11", Node.State.DRAINED, heard_hours_ago=24 * 365)
    call_command("prunehistory", stdout=io.StringIO())
    assert Node.objects.filter(name="slurm-gpu07-job11").exists()
