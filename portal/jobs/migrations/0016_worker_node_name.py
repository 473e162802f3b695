"""A worker's node name kept on its row, and its node nullable: a drained pool node is pruned after
its retention (portal.cluster.pool_nodes) while the job's worker history stays."""

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def copy_node_names(apps, schema_editor):  # type: ignore[no-untyped-def]
    worker = apps.get_model("jobs", "Worker")
    node = apps.get_model("cluster", "Node")
    worker.objects.update(node_name=Subquery(node.objects.filter(pk=OuterRef("node_id")).values("name")[:1]))


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0008_node_redis_password"),
        ("jobs", "0015_own_packages"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="node_name",
            field=models.CharField(default="", help_text="its node's name, which outlives a pruned node", max_length=100),
            preserve_default=False,
        ),
        migrations.RunPython(copy_node_names, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="worker",
            name="node",
            field=models.ForeignKey(
                blank=True, help_text="null once its node, a drained pool node, was pruned (portal.cluster.pool_nodes)",
                null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="workers", to="cluster.node",
            ),
        ),
    ]
