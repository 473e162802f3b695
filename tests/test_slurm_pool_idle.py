"""When the Slurm pool holds an agent idle (portal.slurm.pool._observe, then the sizing): its
idle clock starts when its node really became idle (its last worker's exit), not at the pass
that last saw it busy; and an agent whose node drains, or was lost mid-drain, is leaving, never
an idle give-back. The queue is given as squeue would list it (the real Slurm runs in
test_slurm_pool_pass.py); the nodes, workers and rows are the test database's."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from elastic.wire import slurm_node_name
from portal.cluster.models import Device, Node
from portal.jobs.models import Job, Worker
from portal.slurm.commands import SlurmJob
from portal.slurm.models import SlurmAgentJob
from portal.slurm.pool import _observe
from portal.slurm.sizing import Phase, PoolLimits, size_pool
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

HOST = "gpu07"
IDLE_S = 120.0
LIMITS = PoolLimits(devices_per_agent=1, max_agents=4, idle_s=IDLE_S, start_timeout_s=600)


def _running(job_id: int, started_s_ago: float) -> SlurmJob:
    now = timezone.now().timestamp()
    return SlurmJob(job_id=job_id, name="bungee-agent", user="bungee", state="RUNNING", reason="None",
                    batch_host=HOST, submit_time=now - started_s_ago - 1, start_time=now - started_s_ago)


def _node(job_id: int, state: str = Node.State.ONLINE, drain_cause: str = "") -> Node:
    node = Node.objects.create(name=slurm_node_name(HOST, job_id, "slurm"), address="127.0.0.1", backend="simulated",
                               last_seen_at=timezone.now(), state=state, drain_cause=drain_cause)
    Device.objects.create(node=node, index=0, uuid=f"{node.name}-0", name="slot", kind="cpu-slot")
    return node


def test_the_idle_clock_starts_at_the_last_workers_exit_not_at_the_last_busy_pass(users: dict[str, Any]) -> None:
    now = timezone.now()
    node = _node(11)
    # The last pass that saw a job on it was long ago (passes were sparse); its worker left 2 s ago.
    SlurmAgentJob.objects.create(slurm_job_id=11, state="RUNNING", phase=Phase.ONLINE, node_name=node.name,
                                 submitted_at=now - timedelta(hours=1), busy_at=now - timedelta(seconds=300))
    job = Job.objects.create(owner=users["alice"], name="left", workload="digits-mlp", spec=VALID_SPEC,
                             min_workers=1, max_workers=1, priority="guaranteed", consistency="strict", total_steps=5)
    Worker.objects.create(job=job, generation=1, rank=0, node=node, device_index=0, state=Worker.State.EXITED,
                          started_at=now - timedelta(minutes=30), exited_at=now - timedelta(seconds=2))
    (agent,) = _observe([_running(11, started_s_ago=3600)], now, "slurm")
    assert agent.phase == Phase.ONLINE and agent.idle_for_s == pytest.approx(2, abs=1), agent
    assert size_pool(0, 1, [agent], LIMITS).cancel == {}, "idle for 2 s, not 300"


def test_a_node_that_never_held_a_job_is_idle_since_its_agent_job_started(db: Any) -> None:
    now = timezone.now()
    _node(12)
    (agent,) = _observe([_running(12, started_s_ago=IDLE_S + 30)], now, "slurm")
    assert agent.idle_for_s == pytest.approx(IDLE_S + 30, abs=1)
    assert list(size_pool(0, 1, [agent], LIMITS).cancel) == [12]


@pytest.mark.parametrize(("state", "cause"), [
    (Node.State.DRAINING, "operator"),
    (Node.State.DRAINED, "slurm_preemption"),
    (Node.State.LOST, "slurm_preemption"),  # fell silent mid-drain
])
def test_a_node_that_drains_is_leaving_never_an_idle_give_back(db: Any, state: str, cause: str) -> None:
    now = timezone.now()
    _node(13, state=state, drain_cause=cause)
    (agent,) = _observe([_running(13, started_s_ago=3600)], now, "slurm")
    assert agent.phase == Phase.LEAVING, agent
    assert size_pool(0, 0, [agent], LIMITS).cancel == {}
