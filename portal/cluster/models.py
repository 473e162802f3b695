"""Nodes and their devices, as the agents report them, and the downsampled sample history."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import models

from elastic.wire import member_key
from portal.accounts.models import ApiToken
from portal.cluster.node_states import NodeState, check_node_transition


class Node(models.Model):
    State = NodeState
    """Its lifecycle: portal.cluster.node_states lists every transition; `move` performs them."""

    name = models.CharField(max_length=100, unique=True)
    address = models.CharField(max_length=255)
    backend = models.CharField(max_length=30)
    state = models.CharField(max_length=12, choices=State.choices, default=State.ONLINE)
    registered_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField()
    drain_cause = models.CharField(
        max_length=20, blank=True, help_text="why it drains or drained (elastic.wire.DRAIN_CAUSES)"
    )
    drain_deadline_at = models.DateTimeField(null=True, blank=True, help_text="when a draining node's devices leave")
    agent_token = models.OneToOneField(
        ApiToken,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="node",
        help_text="the agent token that registered the node: only it may register or report for it; "
        "deleting the token frees the node for another",
    )
    redis_password_sha256 = models.CharField(
        max_length=64,
        blank=True,
        help_text="SHA-256 of the password of the node's Redis user (portal.redis_users), made again from it "
        "after Redis restarted; the password itself is never stored",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def move(self, target: NodeState, sources: Iterable[NodeState] | None = None, **fields: Any) -> bool:
        """Moves this node to `target` if it is still in one of `sources` (by default the state
        this object holds): a conditional UPDATE, which also sets `fields`. Returns whether this
        call moved it (exactly one row changed). Raises InvalidNodeTransition if the state
        machine does not allow one of `sources` -> `target` (portal.cluster.node_states)."""
        sources = (NodeState(self.state),) if sources is None else tuple(sources)
        for source in sources:
            check_node_transition(source, target)
        changed = Node.objects.filter(pk=self.pk, state__in=sources).update(state=target, **fields)
        if changed == 1:
            self.state = target
            for name, value in fields.items():
                setattr(self, name, value)
        return changed == 1


class ReportRefusals(models.Model):
    """How many items of a node's reports the portal refused, by why: a count per node and
    reason, kept so that `/metrics` can say it (portal.cluster.ingest.count_refused writes it)."""

    class Reason(models.TextChoices):
        INVALID = "invalid", "not a valid item"
        NOT_ITS_WORKER = "not_its_worker", "about a worker the node does not hold"
        UNKNOWN_JOB = "unknown_job", "about a job that does not exist"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="refusals")
    reason = models.CharField(max_length=20, choices=Reason.choices)
    count = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["node", "reason"]
        constraints = [models.UniqueConstraint(fields=["node", "reason"], name="report_refusals_unique_reason")]


class Device(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100)
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=20)
    memory_total_bytes = models.BigIntegerField(default=0)
    present = models.BooleanField(default=True, help_text="still reported by the node's agent")
    owner_present = models.BooleanField(
        default=False, help_text="a process the agent did not start is on it: its owner took it back"
    )
    owner_since = models.DateTimeField(null=True, blank=True)
    owner = models.CharField(
        max_length=100,
        blank=True,
        help_text="who the device belongs to, if not the shared pool: it is only lent, to opportunistic jobs",
    )
    last_history_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="device_unique_index")]

    def __str__(self) -> str:
        """Its member key, the name agents and workers know it by (portal.cluster.devices)."""
        return member_key(self.node.name, self.index)

    @property
    def usable(self) -> bool:
        return self.present and not self.owner_present and self.node.state == Node.State.ONLINE


class DeviceSample(models.Model):
    """History: one sample per device per BUNGEE SAMPLE_HISTORY_EVERY_S, and past
    DEVICE_SAMPLES_FULL_HOURS one per DEVICE_SAMPLES_BUCKET_S, the mean of the samples it
    replaced (portal.cluster.history). The latest sample of every device lives in Redis, not
    here."""

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="samples")
    taken_at = models.DateTimeField(db_index=True)
    utilization_pct = models.FloatField()
    memory_used_bytes = models.BigIntegerField()
    temperature_c = models.FloatField(null=True)
    power_w = models.FloatField(null=True)
    averaged_over_s = models.PositiveIntegerField(
        default=0, help_text="0: one sample as taken; N: the mean of the device's samples over N seconds from taken_at"
    )

    class Meta:
        ordering = ["taken_at"]
        indexes = [
            models.Index(fields=["device", "taken_at"]),
            models.Index(fields=["averaged_over_s", "taken_at"], name="devicesample_resolution_time"),
        ]
