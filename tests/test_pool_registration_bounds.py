"""A pool token registers only what its pool started. The Slurm pool's token: only the node of an
agent job the pool submitted (its SlurmAgentJob record), under the host squeue gives it, once
while that node lives, with at most the devices the pool asked Slurm for; a made-up name, a job
the pool never submitted, a second node of one job and more devices are 403 naming the name or
the count. Any other pool (a Kubernetes DaemonSet's): only within BUNGEE_POOL_LIMITS (how many
of its nodes at once, how many devices each), and nothing where it sets no bound. Nothing
refused is stored, and no token is issued for it."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from portal.slurm.models import SlurmAgentJob
from portal.slurm.sizing import Phase
from tests.conftest import ApiClient
from tests.test_agent_node_binding import registration

pytestmark = pytest.mark.django_db


def pool_client(users: dict, pool: str) -> ApiClient:
    return ApiClient(ApiToken.issue(users["alice"], f"pool {pool}", ApiToken.Role.POOL, pool=pool)[1])


def submitted(job_id: int, node_name: str = "") -> None:
    """The pool's record of an agent job it submitted (as portal.slurm.pool keeps it)."""
    SlurmAgentJob.objects.create(slurm_job_id=job_id, state="RUNNING" if node_name else "PENDING",
                                 phase=Phase.STARTING if node_name else Phase.PENDING, node_name=node_name,
                                 submitted_at=timezone.now())


def refused(reply: Any, *said: str) -> None:
    assert reply.status_code == 403, reply.content
    error = reply.json()["error"]
    assert error["code"] == "forbidden" and all(words in error["message"] for words in said), error


def issued() -> int:
    return ApiToken.objects.filter(issued_by__isnull=False).count()


@pytest.fixture
def slurm_pool(settings: Any) -> None:
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={
        "enabled": True, "pool": "slurm", "gres": "slot:2", "portal_url": "http://portal.example:8000",
        "token_file": "/shared/bungee/pool.token",
    })


@pytest.mark.usefixtures("slurm_pool")
def test_the_slurm_pools_token_registers_only_its_agent_jobs_with_the_devices_asked(users: dict) -> None:
    pool = pool_client(users, "slurm")
    submitted(42)
    submitted(43, node_name="slurm-gpu03-job43")

    refused(pool.post("/api/agent/register", registration("slurm-evil", devices=2)), "'slurm-evil'")
    refused(pool.post("/api/agent/register", registration("slurm-gpu01-job999")), "999")
    too_many = pool.post("/api/agent/register", registration("slurm-gpu01-job42", devices=4))
    refused(too_many, "'slurm-gpu01-job42' registers 4 devices", "asked Slurm for 2")
    refused(pool.post("/api/agent/register", registration("slurm-gpu04-job43")), "'slurm-gpu03-job43'")
    assert not Node.objects.exists() and issued() == 0

    assert pool.post("/api/agent/register", registration("slurm-gpu01-job42", devices=2)).status_code == 200
    assert pool.post("/api/agent/register", registration("slurm-gpu03-job43", devices=1)).status_code == 200
    again = pool.post("/api/agent/register", registration("slurm-gpu02-job42"))
    refused(again, "'slurm-gpu02-job42'", "registered already, as node 'slurm-gpu01-job42'")
    assert set(Node.objects.values_list("name", flat=True)) == {"slurm-gpu01-job42", "slurm-gpu03-job43"}
    assert issued() == 2

    # Requeued after a preemption, the job runs again elsewhere: its old node was lost meanwhile.
    Node.objects.filter(name="slurm-gpu01-job42").update(state=Node.State.LOST)
    assert pool.post("/api/agent/register", registration("slurm-gpu02-job42")).status_code == 200


@pytest.mark.usefixtures("slurm_pool")
def test_another_pools_token_is_not_taken_for_the_slurm_pools(users: dict) -> None:
    submitted(42)
    reply = pool_client(users, "k8s").post("/api/agent/register", registration("k8s-slurm-gpu01-job42"))
    refused(reply, "BUNGEE_POOL_LIMITS")


def test_a_pool_the_portal_does_not_start_registers_within_its_operators_bound(users: dict, settings: Any) -> None:
    pool = pool_client(users, "k8s")
    refused(pool.post("/api/agent/register", registration("k8s-n1")), "BUNGEE_POOL_LIMITS")
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"pool_limits": ["k8s:2:4"]})
    refused(pool.post("/api/agent/register", registration("k8s-n1", devices=5)), "'k8s-n1' registers 5 devices")
    assert pool.post("/api/agent/register", registration("k8s-n1", devices=4)).status_code == 200
    assert pool.post("/api/agent/register", registration("k8s-n2", devices=1)).status_code == 200
    third = pool.post("/api/agent/register", registration("k8s-evil", devices=1))
    refused(third, "'k8s-evil'", "at most 2")
    assert issued() == 2
    Node.objects.filter(name="k8s-n2").update(state=Node.State.DRAINED)
    assert pool.post("/api/agent/register", registration("k8s-n3", devices=1)).status_code == 200
