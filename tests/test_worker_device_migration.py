"""Migration jobs.0014 gives every worker row its device, from its node and the device index its
agent reported; a row whose node never registered that index keeps none. Nothing stored is lost:
the node and the index stay."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("jobs", "0013_step_rate"), ("cluster", "0007_node_drain")]
AFTER = [("jobs", "0014_worker_device")]


def test_worker_rows_get_their_device_from_node_and_index() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    apps = executor.loader.project_state(BEFORE).apps
    user_model = apps.get_model("auth", "User")
    node_model = apps.get_model("cluster", "Node")
    device_model = apps.get_model("cluster", "Device")
    job_model = apps.get_model("jobs", "Job")
    worker_model = apps.get_model("jobs", "Worker")
    owner = user_model.objects.create(username="migrating")
    nodes = [
        node_model.objects.create(
            name=name, address="127.0.0.1", backend="simulated", last_seen_at=timezone.now()
        )
        for name in ("node-a", "node-b")
    ]
    devices = {
        (node.name, index): device_model.objects.create(
            node=node, index=index, uuid=f"{node.name}-{index}", name="CPU slot", kind="cpu-slot"
        )
        for node in nodes
        for index in (0, 1)
    }
    job = job_model.objects.create(
        owner=owner, name="j", workload="digits-mlp", spec={}, min_workers=1, max_workers=4, total_steps=10
    )
    placed = [(nodes[0], 1), (nodes[1], 0), (nodes[1], 1), (nodes[0], 7)]
    for rank, (node, index) in enumerate(placed):
        worker_model.objects.create(
            job=job, generation=1, rank=rank, node=node, device_index=index, pid=100 + rank
        )

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    worker_model = executor.loader.project_state(AFTER).apps.get_model("jobs", "Worker")
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())  # the schema the other tests expect
    rows = {row.rank: row for row in worker_model.objects.all()}
    assert [rows[rank].device_id for rank in range(4)] == [
        devices[("node-a", 1)].pk,
        devices[("node-b", 0)].pk,
        devices[("node-b", 1)].pk,
        None,
    ], "node-a never registered device 7"
    assert [(rows[rank].node_id, rows[rank].device_index) for rank in range(4)] == [
        (node.pk, index) for node, index in placed
    ]
