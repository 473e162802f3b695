"""What one scheduling cycle asks the database: the cluster's devices are read once, whatever
the cycle does (a first plan and launch, a resize of a job whose workers hold the state, a
cycle with nothing to change). The cycle builds one view of the world (portal.scheduling.
snapshot.CycleView) and planning, publishing and the decision record all take it."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from elastic.membership import GenerationPhase
from portal.cluster.models import Node
from portal.jobs import lifecycle
from portal.jobs.models import Allocation, Generation, Job
from portal.scheduling.cycle import CycleResult, run_cycle
from tests.conftest import VALID_SPEC
from tests.test_scheduler_cycle import form, submit

pytestmark = pytest.mark.django_db

DEVICE_TABLE = re.compile(r'\bFROM "cluster_device"|JOIN "cluster_device"')


def device_reads(queries: list[dict[str, Any]]) -> list[str]:
    """The queries that read the Device table (a SELECT from it, or one joining it)."""
    return [
        q["sql"]
        for q in queries
        if q["sql"].lstrip().upper().startswith("SELECT") and DEVICE_TABLE.search(q["sql"])
    ]


def counted_cycle() -> tuple[CycleResult, list[dict[str, Any]]]:
    with CaptureQueriesContext(connection) as captured:
        result = run_cycle()
    return result, captured.captured_queries


def test_a_first_plan_and_launch_reads_the_devices_once(api: dict, cluster: Any, redis_client: Any) -> None:
    jobs = [submit(api, name="first"), submit(api, name="second")]
    result, queries = counted_cycle()
    assert sorted(result.launched_jobs) == sorted(job.pk for job in jobs), (
        "the cycle planned and launched both"
    )
    assert len(device_reads(queries)) == 1, device_reads(queries)


def test_a_resize_of_a_running_job_reads_the_devices_once(api: dict, cluster: Any, redis_client: Any) -> None:
    job = submit(api, max_workers=4)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 4)
    submit(api, name="newcomer", min_workers=2)
    api["alice"].post(f"/api/jobs/{job.pk}/resize", {"workers": 2})
    result, queries = counted_cycle()
    assert job.pk in result.changed_jobs and job.pk in result.launched_jobs, "the running job shrank in place"
    assert len(device_reads(queries)) == 1, device_reads(queries)


@pytest.mark.parametrize("formed", [False, True], ids=["joiners-warming-up", "formed"])
def test_a_cycle_with_nothing_to_change_reads_the_devices_once(
    api: dict, cluster: Any, redis_client: Any, formed: bool
) -> None:
    """Before the group forms, the published generation's deadline is checked against its
    joiners (expire_overdue); after, the workers hold the state."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    if formed:
        form(cluster, job, 2)
    result, queries = counted_cycle()
    assert result.changed_jobs == [] and result.launched_jobs == []
    assert len(device_reads(queries)) == 1, device_reads(queries)


def test_a_cycle_that_finds_a_node_lost_reads_the_devices_once(
    api: dict, cluster: Any, redis_client: Any
) -> None:
    """The lost node's workers are gone, their devices left out of the next plan (nodes_lost),
    without a lookup of each worker's device."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2)
    held = sorted(Allocation.objects.filter(job=job).values_list("device_id", flat=True))
    Node.objects.filter(pk=cluster.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))
    result, queries = counted_cycle()
    assert Node.objects.get(pk=cluster.pk).state == Node.State.LOST
    generation = Generation.objects.get(job=job, number=1)
    assert (generation.phase, sorted(generation.excluded_devices)) == ("lost", held), (
        "its workers' devices left out"
    )
    assert result.changed_jobs == [job.pk] and Job.objects.get(pk=job.pk).state == "queued"
    assert len(device_reads(queries)) == 1, device_reads(queries)


def test_the_newest_generation_of_each_job_is_read_alone(users: dict[str, Any]) -> None:
    """Each cycle's snapshot asks for the newest generation of every active job
    (lifecycle.newest_generations). A job planned many times keeps every generation's row; one
    query reads the newest of each job, and only those rows."""
    planned_times = {"planned-many-times": 40, "planned-once": 1, "never-planned": 0}
    jobs = {}
    for name, generations in planned_times.items():
        job = Job.objects.create(
            owner=users["alice"], name=name, workload="digits-mlp", spec=VALID_SPEC, min_workers=1,
            max_workers=2, priority="guaranteed", consistency="strict", total_steps=50, generation=generations,
        )
        Generation.objects.bulk_create(
            Generation(job=job, number=number, reason="test",
                       phase=GenerationPhase.SETTLED if number == generations else GenerationPhase.SUPERSEDED)
            for number in range(1, generations + 1)
        )
        jobs[name] = job
    built: list[Generation] = []

    def count(sender: type[Generation], instance: Generation, **_: Any) -> None:
        built.append(instance)

    post_init.connect(count, sender=Generation)
    try:
        with CaptureQueriesContext(connection) as captured:
            newest = lifecycle.newest_generations(job.pk for job in jobs.values())
    finally:
        post_init.disconnect(count, sender=Generation)
    assert {job_id: (row.number, row.phase) for job_id, row in newest.items()} == {
        jobs["planned-many-times"].pk: (40, "settled"),
        jobs["planned-once"].pk: (1, "settled"),
    }
    assert len(captured.captured_queries) == 1, captured.captured_queries
    assert len(built) == len(newest), f"{len(built)} generation rows read for {len(newest)} jobs"
