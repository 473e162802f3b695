"""The scheduler's decisions, newest first, for the staff page: what the policy planned for
every job, why, and how long it took. Only the last BUNGEE_DECISIONS_KEPT are kept."""

from __future__ import annotations

from django.db import models


class SchedulerDecision(models.Model):
    decided_at = models.DateTimeField(auto_now_add=True, db_index=True)
    policy = models.CharField(max_length=40)
    resize_cost_s = models.FloatField()
    decision_ms = models.FloatField(help_text="time the policy took to plan, in milliseconds")
    devices_total = models.PositiveIntegerField()
    devices_available = models.PositiveIntegerField()
    jobs = models.JSONField(
        default=list,
        help_text="per job: id, name, owner, priority, workers now, target devices, reasons, note, "
        "pin problem, batch size",
    )
    lent_devices = models.JSONField(default=list, help_text="owned devices lent to a job: device, owner, job")
    stragglers = models.JSONField(default=list, help_text="slow workers and what the plan does about them")
    changed_jobs = models.JSONField(default=list, help_text="jobs that got a new generation")

    class Meta:
        ordering = ["-decided_at", "-id"]

    def __str__(self) -> str:
        return f"{self.policy} at {self.decided_at:%H:%M:%S} ({self.decision_ms:.1f} ms)"
