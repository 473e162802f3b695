"""The portal when a node's agent dies and comes back while its workers train on (the database and
Redis of this machine): a silent node whose workers' heartbeats are fresh is unreachable, not
lost, and nothing is planned again; once the heartbeats stop too it is lost, and its resize says
so. An agent that registers with the workers it re-adopted keeps their rows; only the jobs that
really lost a worker are planned again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from elastic.wire import RunningWorker
from portal.dispatch import board
from portal.jobs import lifecycle
from portal.jobs.agents import register
from portal.jobs.lifecycle import WorkerRow, nodes_lost, workers_gone_at_registration
from portal.jobs.models import Job, ResizeEvent, Worker
from portal.scheduling.cycle import run_cycle
from tests.conftest import cluster_registration
from tests.test_scheduler_cycle import event, report, submit

pytestmark = pytest.mark.django_db


def formed(node: Any, job: Job, pid_base: int) -> list[tuple[int, int]]:
    """Reports the job's workers of its generation as started and joined, each on the device the
    plan gave it, with pid `pid_base` + rank; returns their (device index, pid)."""
    devices = list(job.allocations.order_by("rank").values_list("device__index", flat=True))
    for rank, index in enumerate(devices):
        report(node, event(job, "started", rank=rank, pid=pid_base + rank, device_index=index))
        report(node, event(job, "joined", rank=rank, pid=pid_base + rank, device_index=index))
    report(node, event(job, "resized"))
    return [(index, pid_base + rank) for rank, index in enumerate(devices)]


def silence(node: Any, minutes: float = 5) -> None:
    from django.utils import timezone

    from portal.cluster.models import Node

    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now() - timedelta(minutes=minutes))


def running_rows(job: Job) -> list[tuple[int, int | None]]:
    return sorted(job.workers.filter(state=Worker.State.RUNNING).values_list("rank", "pid"))


def test_a_silent_node_whose_workers_beat_is_unreachable_until_the_heartbeats_stop(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    workers = formed(cluster, job, 1000)
    generation = job.generation
    silence(cluster)
    for index, pid in workers:
        board(job.pk).beat(f"node-a/{index}", pid)

    assert nodes_lost() == []
    cluster.refresh_from_db()
    assert cluster.state == "unreachable"
    job.refresh_from_db()
    assert running_rows(job) == [(0, 1000), (1, 1001)] and not lifecycle.needs_replan(lifecycle.current(job))
    assert run_cycle().changed_jobs == [], "nothing is planned again while the workers train on"
    job.refresh_from_db()
    assert (job.state, job.generation) == ("running", generation)

    # A heartbeat under another pid is another process's: it does not keep the node.
    for index, _ in workers:
        board(job.pk).beat(f"node-a/{index}", 4242)
    assert nodes_lost() == ["node-a"]
    cluster.refresh_from_db()
    job.refresh_from_db()
    assert cluster.state == "lost" and running_rows(job) == [] and lifecycle.needs_replan(lifecycle.current(job))
    assert set(job.workers.values_list("reason", flat=True)) == {"node lost"}
    run_cycle()
    assert ResizeEvent.objects.filter(job=job).latest("generation").reason == "node lost"


def test_a_silent_node_without_heartbeats_is_lost(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    formed(cluster, job, 1000)
    silence(cluster)
    assert nodes_lost() == ["node-a"]
    cluster.refresh_from_db()
    assert cluster.state == "lost"


def test_an_agent_silent_past_the_unreachable_timeout_loses_its_node_and_its_workers_are_told_to_leave(
    api: dict, cluster: Any, redis_client: Any, settings: Any
) -> None:
    """The workers beat on, but the agent has been silent longer than UNREACHABLE_TIMEOUT_S: the
    node is lost (it no longer stays "agent unreachable" without limit), the job is planned
    again, and each worker still beating reads at its next beat that it must leave."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"unreachable_timeout_s": 120.0})
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    workers = formed(cluster, job, 1000)
    silence(cluster, minutes=1)
    for index, pid in workers:
        assert not board(job.pk).beat(f"node-a/{index}", pid), "nobody was told to leave yet"
    assert nodes_lost() == []
    cluster.refresh_from_db()
    assert cluster.state == "unreachable"

    silence(cluster, minutes=3)
    assert nodes_lost() == ["node-a"]
    cluster.refresh_from_db()
    job.refresh_from_db()
    assert cluster.state == "lost" and running_rows(job) == []
    assert lifecycle.needs_replan(lifecycle.current(job))
    assert "agent unreachable for 180 s" in lifecycle.current(job).note
    for index, pid in workers:
        assert board(job.pk).beat(f"node-a/{index}", pid), "the worker reads that it must leave"
        assert not board(job.pk).beat(f"node-a/{index}", pid + 1), "another process on the device is not told"


def test_a_report_brings_an_unreachable_node_back(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for index, pid in formed(cluster, job, 1000):
        board(job.pk).beat(f"node-a/{index}", pid)
    silence(cluster)
    nodes_lost()
    report(cluster)
    cluster.refresh_from_db()
    assert cluster.state == "online"


def test_an_agent_back_with_its_workers_keeps_them_and_replans_only_what_was_lost(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    kept, hurt = submit(api, name="kept"), submit(api, name="hurt")
    run_cycle()
    kept.refresh_from_db()
    hurt.refresh_from_db()
    kept_workers, hurt_workers = formed(cluster, kept, 1000), formed(cluster, hurt, 2000)
    assert len(kept_workers) == len(hurt_workers) == 2

    def alive(job: Job, rank: int, index: int, pid: int) -> RunningWorker:
        return RunningWorker(job_id=job.pk, generation=job.generation, rank=rank, pid=pid, device_index=index)

    register(
        cluster_registration(
            *(alive(kept, rank, index, pid) for rank, (index, pid) in enumerate(kept_workers)),
            alive(hurt, 0, *hurt_workers[0]),
        )
    )
    kept.refresh_from_db()
    hurt.refresh_from_db()
    assert running_rows(kept) == [(0, 1000), (1, 1001)] and not lifecycle.needs_replan(lifecycle.current(kept))
    assert running_rows(hurt) == [(0, 2000)] and lifecycle.needs_replan(lifecycle.current(hurt))
    assert hurt.workers.get(rank=1).reason == "agent restart: gone"


def test_an_agent_back_without_workers_replans_every_job_it_ran(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    formed(cluster, job, 1000)
    register(cluster_registration())
    job.refresh_from_db()
    assert running_rows(job) == [] and lifecycle.needs_replan(lifecycle.current(job))


@pytest.mark.parametrize(
    ("readopted", "allocated", "gone", "replan"),
    [
        # Matched by job, device and pid: a generation behind by a "joined" on its way is the same worker.
        ([(1, 0, 100, 5)], {(1, 0)}, set(), set()),
        ([], {(1, 0)}, {10}, {1}),
        ([(1, 0, 999, 1)], {(1, 0)}, {10}, {1}),
        # A device of the job's plan where no worker runs (a launch missed while the agent was away).
        ([(1, 0, 100, 1)], {(1, 0), (1, 3)}, set(), {1}),
    ],
)
def test_which_workers_an_agent_restart_lost(
    readopted: list[tuple[int, int, int, int]],
    allocated: set[tuple[int, int]],
    gone: set[int],
    replan: set[int],
) -> None:
    rows = [WorkerRow(id=10, job_id=1, device_index=0, pid=100)]
    running = [
        RunningWorker(job_id=job_id, device_index=index, pid=pid, generation=generation, rank=0)
        for job_id, index, pid, generation in readopted
    ]
    assert workers_gone_at_registration(rows, running, allocated) == (gone, replan)
