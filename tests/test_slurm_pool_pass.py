"""The Slurm pool's task (portal.slurm.tasks) against the suite's real Slurm, the test database
and Redis: a job that wants more devices than the cluster has makes it submit agent jobs (each
running the real agent inside its allocation), never more than the demand; once their nodes are
in the cluster and nobody wants them, they are cancelled; an agent job that never registers is
cancelled; a Slurm command that fails is an error on the Scheduler page.

The agents here reach no portal (a closed port), so they stay "starting" until the test puts
their nodes in the database as registration would (the pool credential that lets pool agents
register is tested with the pool token; the end-to-end test of agents in Slurm comes with it)."""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from elastic.wire import DrainNotice, slurm_node_name
from portal.cluster import drain
from portal.cluster.models import Device, Node
from portal.jobs import lifecycle
from portal.jobs.models import Job
from portal.slurm.commands import SlurmCommands
from portal.slurm.models import SlurmAgentJob, SlurmPoolEvent, SlurmPoolPass
from portal.slurm.tasks import size_slurm_pool
from tests.conftest import VALID_SPEC
from tests.slurm_support import PROJECT_ROOT, SlurmCluster, slurm, wait_until

__all__ = ["slurm"]  # fixture, used by name

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

Kind = SlurmPoolEvent.Kind


@pytest.fixture
def pool(slurm: SlurmCluster, settings: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SlurmCluster]:
    """The pool switched on against the test cluster: agent jobs of slot:2, three at most."""
    token = tmp_path / "pool.token"
    token.write_text("not-a-real-token\n")
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={
        "enabled": True, "partition": slurm.pool, "gres": f"{slurm.gres}:2",
        "max_agents": 3, "idle_s": 0.0, "start_timeout_s": 3600.0, "portal_url": "http://127.0.0.1:9",
        "token_file": str(token), "python": str(PROJECT_ROOT / ".venv" / "bin" / "python"),
        "workdir": str(PROJECT_ROOT), "output": str(tmp_path / "agents" / "%x-%j.out"),
        "agent_args": "--standbys off",
        # Each agent's state directory under the test's own data dir (job ids start at 1 in every
        # test cluster: under one data dir two runs' agents would share one).
        "export": "ALL", "agent_data_dir": str(tmp_path / "data"),
    })
    yield slurm
    slurm.cancel_all()


def _job(users: dict[str, Any], max_workers: int) -> Job:
    return Job.objects.create(
        owner=users["alice"], name="wants-more", workload="digits-mlp", spec=VALID_SPEC, min_workers=1,
        max_workers=max_workers, priority="guaranteed", consistency="strict", total_steps=50,
    )


def _agent_jobs(cluster: SlurmCluster) -> dict[int, str]:
    listed = SlurmCommands(20, cluster.env).jobs("bungee-agent", getpass.getuser())
    return {job.job_id: job.state for job in listed}


def _register(cluster: SlurmCluster, job_id: int, devices: int) -> Node:
    """What the portal holds once the agent of Slurm job `job_id` has registered."""
    node = Node.objects.create(name=slurm_node_name(cluster.nodes[0], job_id, "slurm"), address="127.0.0.1",
                               backend="simulated", last_seen_at=timezone.now())
    for index in range(devices):
        Device.objects.create(node=node, index=index, uuid=f"{node.name}-{index}", name="slot", kind="cpu-slot")
    return node


def test_the_pool_grows_with_demand_and_shrinks_when_idle(
    pool: SlurmCluster, users: dict[str, Any], tmp_path: Path
) -> None:
    job = _job(users, max_workers=4)
    first = size_slurm_pool()
    assert first is not None and len(first["submitted"]) == 2 and first["cancelled"] == []
    submitted = first["submitted"]
    assert set(_agent_jobs(pool)) == set(submitted)
    assert list(SlurmPoolEvent.objects.filter(kind=Kind.SUBMITTED).values_list("slurm_job_id", flat=True)) == \
        sorted(submitted, reverse=True)
    # Their agents run inside the allocations; until they register, they count as on their way.
    wait_until(lambda: set(_agent_jobs(pool).values()) == {"RUNNING"}, 60, "both agent jobs running")
    for job_id in submitted:  # the real agent, inside its allocation, trying to reach the portal
        output = tmp_path / "agents" / f"bungee-agent-{job_id}.out"
        wait_until(lambda o=output: o.exists() and "registering with http://127.0.0.1:9 failed" in o.read_text(),
                   60, f"agent job {job_id}'s agent trying to register")
        assert (tmp_path / "data" / "agent" / slurm_node_name(pool.nodes[0], job_id, "slurm")).is_dir()
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}
    assert SlurmPoolPass.objects.get().starting == 2

    nodes = [_register(pool, job_id, devices=2) for job_id in submitted]
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}, "wanted as long as the job wants 4"
    assert (SlurmPoolPass.objects.get().online, SlurmPoolPass.objects.get().unmet_devices) == (2, 0)

    lifecycle.cancel(job)
    done = size_slurm_pool()
    assert done is not None and sorted(done["cancelled"]) == sorted(submitted) and done["submitted"] == []
    wait_until(lambda: not _agent_jobs(pool), 60, "the idle agent jobs gone from Slurm")
    for node in nodes:
        job_id = int(node.name.rsplit("job", 1)[1])
        assert "idle for" in SlurmPoolEvent.objects.get(kind=Kind.CANCELLED, slurm_job_id=job_id).message
        # Its agent says what its TERM was: the pool's give-back, not a preemption it cannot know.
        output = (tmp_path / "agents" / f"bungee-agent-{job_id}.out").read_text()
        assert "draining: idle, given back to Slurm" in output, output[-2000:]
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}
    assert not SlurmAgentJob.objects.exists()
    # Each drained agent removed its job's state directory on its way out.
    assert list((tmp_path / "data" / "agent").iterdir()) == []


def test_never_more_pending_agent_jobs_than_the_demand(pool: SlurmCluster, users: dict[str, Any]) -> None:
    # Three agents of two slots on a node of four: the third waits in Slurm's queue.
    job = _job(users, max_workers=6)
    assert len(size_slurm_pool()["submitted"]) == 3  # type: ignore[index]
    wait_until(lambda: sorted(_agent_jobs(pool).values()) == ["PENDING", "RUNNING", "RUNNING"], 60,
               "two agent jobs running, one pending")
    pending = [job_id for job_id, state in _agent_jobs(pool).items() if state == "PENDING"]
    running = [job_id for job_id, state in _agent_jobs(pool).items() if state == "RUNNING"]
    for job_id in running:
        _register(pool, job_id, devices=2)
    # The job now wants four: the two online agents cover it, the pending one is cancelled.
    job.max_workers = 4
    job.save(update_fields=["max_workers"])
    assert size_slurm_pool() == {"submitted": [], "cancelled": pending}
    assert "pending beyond the demand" in SlurmPoolEvent.objects.get(kind=Kind.CANCELLED).message


def test_an_agent_that_never_registers_is_cancelled(pool: SlurmCluster, users: dict[str, Any], settings: Any) -> None:
    _job(users, max_workers=2)
    (submitted,) = size_slurm_pool()["submitted"]  # type: ignore[index]
    wait_until(lambda: _agent_jobs(pool).get(submitted) == "RUNNING", 60, "the agent job running")
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={"start_timeout_s": 0.0})
    result = size_slurm_pool()
    assert result is not None and result["cancelled"] == [submitted]
    assert len(result["submitted"]) == 1, "the demand is still there: another agent job"
    assert "has not registered" in SlurmPoolEvent.objects.get(kind=Kind.CANCELLED).message


def test_a_failing_slurm_command_is_an_error_on_the_scheduler_page(
    pool: SlurmCluster, users: dict[str, Any], settings: Any, client: Any
) -> None:
    _job(users, max_workers=2)
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={"partition": "no-such-partition"})
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}
    error = SlurmPoolEvent.objects.get(kind=Kind.ERROR)
    assert error.message.startswith("sbatch --parsable --job-name=bungee-agent") and "exited 1" in error.message
    assert "invalid partition" in error.message.lower()

    client.force_login(users["staff"])
    page = client.get("/admin/scheduler/").content.decode()
    assert 'id="slurm-pool"' in page and "Invalid partition" in page
    assert "0 online, 0 starting, 0 pending" in page


def test_an_agent_whose_node_drains_is_replaced_at_once_at_the_most_agents(
    pool: SlurmCluster, users: dict[str, Any], settings: Any
) -> None:
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={"max_agents": 2})
    _job(users, max_workers=4)
    submitted = size_slurm_pool()["submitted"]  # type: ignore[index]
    assert len(submitted) == 2
    wait_until(lambda: set(_agent_jobs(pool).values()) == {"RUNNING"}, 60, "both agent jobs running")
    nodes = [_register(pool, job_id, devices=2) for job_id in submitted]
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}

    # Slurm preempts one: its agent says it drains. Its job still runs (the agent drains within
    # its grace); it leaves, and the one that replaces it waits in Slurm's queue for its slots.
    deadline_at = (timezone.now() + timedelta(seconds=20)).timestamp()
    drain.draining(nodes[0], DrainNotice(cause="slurm_preemption", deadline_at=deadline_at))
    replaced = size_slurm_pool()
    assert replaced is not None and len(replaced["submitted"]) == 1 and replaced["cancelled"] == []
    assert SlurmAgentJob.objects.get(slurm_job_id=submitted[0]).phase == "leaving"
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}, "the replacement is on its way"


def test_a_controller_outage_is_a_failed_pass_that_keeps_the_agent_jobs(
    pool: SlurmCluster, users: dict[str, Any], client: Any
) -> None:
    # squeue --json without slurmctld exits 0 with no job and an error: not an empty queue.
    _job(users, max_workers=4)
    submitted = size_slurm_pool()["submitted"]  # type: ignore[index]
    assert len(submitted) == 2
    pool.stop_controller()
    try:
        assert size_slurm_pool() == {"submitted": [], "cancelled": []}, "no sbatch for jobs it cannot see"
        assert sorted(SlurmAgentJob.objects.values_list("slurm_job_id", flat=True)) == sorted(submitted)
        error = SlurmPoolEvent.objects.get(kind=Kind.ERROR)
        assert error.message.startswith("squeue --json") and "slurm_load_jobs" in error.message, error.message
        client.force_login(users["staff"])
        assert "slurm_load_jobs" in client.get("/admin/scheduler/").content.decode()
    finally:
        pool.start_controller()
    assert size_slurm_pool() == {"submitted": [], "cancelled": []}, "the same two agent jobs, found again"
    assert sorted(SlurmAgentJob.objects.values_list("slurm_job_id", flat=True)) == sorted(submitted)
    assert set(_agent_jobs(pool)) == set(submitted)
