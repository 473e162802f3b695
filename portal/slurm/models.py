"""What the Slurm pool knows between passes: its agent jobs as it last saw them in the queue
(when each started, when its node last held a job), the figures of its last pass, and what it
did and what failed, for the Scheduler page. Slurm stays the source of truth for its jobs: the
rows are rewritten from squeue on every pass."""

from __future__ import annotations

from django.db import models


class SlurmAgentJob(models.Model):
    slurm_job_id = models.PositiveBigIntegerField(unique=True)
    state = models.CharField(max_length=30, help_text="Slurm's state at the last pass")
    phase = models.CharField(max_length=12, help_text="portal.slurm.sizing.Phase at the last pass")
    node_name = models.CharField(max_length=100, blank=True, help_text="its Bungee node, once Slurm places it")
    submitted_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    busy_at = models.DateTimeField(
        null=True, blank=True,
        help_text="when its node last held a job, or its job started (its idle time counts from it)",
    )

    class Meta:
        ordering = ["slurm_job_id"]

    def __str__(self) -> str:
        return f"Slurm job {self.slurm_job_id} ({self.phase})"


class SlurmPoolEvent(models.Model):
    class Kind(models.TextChoices):
        SUBMITTED = "submitted"
        CANCELLED = "cancelled"
        ERROR = "error"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=12, choices=Kind.choices)
    slurm_job_id = models.PositiveBigIntegerField(null=True, blank=True)
    message = models.TextField()

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} at {self.at:%H:%M:%S}: {self.message[:60]}"


class SlurmPoolPass(models.Model):
    """The last pass's figures: one row, rewritten."""

    at = models.DateTimeField()
    wanted_devices = models.PositiveIntegerField()
    usable_devices = models.PositiveIntegerField()
    unmet_devices = models.PositiveIntegerField()
    pending = models.PositiveIntegerField()
    starting = models.PositiveIntegerField()
    online = models.PositiveIntegerField()
