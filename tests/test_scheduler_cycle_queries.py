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
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.cluster.models import Node
from portal.jobs.models import Allocation, Generation, Job
from portal.scheduling.cycle import CycleResult, run_cycle
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
