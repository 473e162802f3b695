"""Jobs, their allocations, their worker processes, resize history, metrics and logs."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from elastic.membership import GenerationPhase
from portal.cluster.models import Device, Node
from portal.jobs import eta
from portal.jobs.states import JobState, check_transition

REASON_CHARS = 120
"""The longest reason a list gives for a job's end (Job.ended_reason)."""
_WHICH_WORKER = re.compile(r" on worker rank \d+ of generation \d+")


class Job(models.Model):
    class Priority(models.TextChoices):
        GUARANTEED = "guaranteed"
        OPPORTUNISTIC = "opportunistic"

    class Consistency(models.TextChoices):
        STRICT = "strict"
        HYBRID = "hybrid"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    name = models.CharField(max_length=100)
    workload = models.CharField(max_length=250, help_text="what it trains: a workload, or its code's entrypoint")
    code = models.CharField(max_length=64, blank=True, db_index=True, help_text="sha256 of its own code, if any")
    spec = models.JSONField(help_text="the validated spec, hyperparameters completed with defaults")
    min_workers = models.PositiveIntegerField()
    max_workers = models.PositiveIntegerField()
    priority = models.CharField(max_length=20, choices=Priority.choices)
    consistency = models.CharField(max_length=10, choices=Consistency.choices)
    total_steps = models.PositiveIntegerField()

    state = models.CharField(max_length=12, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    message = models.TextField(blank=True, help_text="why it is in its state, for people")
    generation = models.PositiveIntegerField(default=0, help_text="the newest membership generation planned")
    active_generation = models.PositiveIntegerField(
        default=0, help_text="the newest generation whose group formed: its workers hold the state"
    )
    master_port = models.PositiveIntegerField(null=True, blank=True)
    pinned_workers = models.PositiveIntegerField(null=True, blank=True, help_text="manual resize")
    pin_problem = models.CharField(max_length=300, blank=True, help_text="why the pin is not met")
    pin_requested_by = models.CharField(max_length=150, blank=True, help_text="who asked for the newest pin")
    pin_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="when the newest pin was asked for: a manual resize's land time starts here"
    )
    restarts = models.PositiveIntegerField(default=0, help_text="generations that lost a worker")
    counted_failures = models.JSONField(
        default=list, blank=True,
        help_text="the failures that count against the restart budget: [Unix time, steps done] "
        "(portal.jobs.restarts)",
    )
    batch_size = models.PositiveIntegerField(
        null=True, blank=True, help_text="hybrid jobs: the global batch size the scheduler chose"
    )
    schedule_reasons = models.JSONField(
        default=list, blank=True, help_text="why it has what it has (elastic.scheduling.Reason values)"
    )
    schedule_note = models.CharField(max_length=300, blank=True, help_text="the reasons, for people")
    queue = models.JSONField(
        default=dict, blank=True,
        help_text="a waiting job's place in the queue, who holds its devices, its estimated start "
        "(portal.scheduling.decisions.queue_view); empty while it runs",
    )
    attained_service_s = models.FloatField(default=0.0, help_text="device-seconds trained so far")
    own_packages = models.JSONField(
        null=True, blank=True,
        help_text="the job's own environment as the newest node that built or found it reported it "
        "(elastic.wire.OwnPackages, and that node's name); null: none reported",
    )

    steps_done = models.PositiveIntegerField(default=0)
    last_loss = models.FloatField(null=True, blank=True)
    samples_per_s = models.FloatField(null=True, blank=True)
    global_batch = models.PositiveIntegerField(null=True, blank=True, help_text="of the last step reported")
    learning_rate = models.FloatField(null=True, blank=True, help_text="of the last step reported")
    last_progress_at = models.DateTimeField(null=True, blank=True)
    rate_steps = models.FloatField(default=0.0, help_text="the step rate's decayed steps (portal.jobs.eta)")
    rate_seconds = models.FloatField(default=0.0, help_text="the step rate's decayed seconds (portal.jobs.eta)")

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"

    def refresh_from_db(self, *args: Any, **kwargs: Any) -> None:
        super().refresh_from_db(*args, **kwargs)
        self.__dict__.pop("allocation_count", None)  # the annotation (listed) was of the old row

    def claim(self, target: JobState, **fields: Any) -> bool:
        """Move this job to `target` if it is still in the state this object holds; also sets
        `fields`. Returns whether this call moved it (exactly one row changed). Raises
        InvalidTransition for a move the state machine does not allow."""
        check_transition(self.state, target)
        changed = Job.objects.filter(pk=self.pk, state=self.state).update(state=target, **fields)
        if changed == 1:
            self.state = target
            for name, value in fields.items():
                setattr(self, name, value)
        return changed == 1

    def schedule_view(self) -> dict[str, Any]:
        """What the board, the job page and the API show of the scheduler's view of the job."""
        return {
            "pinned_workers": self.pinned_workers,
            "pin_problem": self.pin_problem,
            "schedule_reasons": list(self.schedule_reasons),
            "schedule_note": self.schedule_note,
            "batch_size": self.batch_size,
            "queue": dict(self.queue),
        }

    def ended_reason(self) -> str:
        """Why a failed or cancelled job ended, short enough for a list: its message's first
        sentence, without the worker it happened on, cut at REASON_CHARS; '' for any other job."""
        if self.state not in (JobState.FAILED, JobState.CANCELLED):
            return ""
        sentence = _WHICH_WORKER.sub("", self.message.split("\n", 1)[0]).split(". ", 1)[0].rstrip(".")
        return sentence if len(sentence) <= REASON_CHARS else sentence[: REASON_CHARS - 1].rstrip() + "…"

    def summary(self) -> dict[str, Any]:
        """What everyone may see of a job: the list, the board, the live `job` events. Reads the
        `allocation_count` annotation where the queryset has it (portal.jobs.api.listed)."""
        return {
            "id": self.pk,
            "name": self.name,
            "owner": self.owner.get_username(),
            "state": self.state,
            "workload": self.workload,
            "priority": self.priority,
            "consistency": self.consistency,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "workers": self.allocation_count if hasattr(self, "allocation_count") else self.workers_now,
            "generation": self.generation,
            "steps_done": self.steps_done,
            "total_steps": self.total_steps,
            "progress": round(self.steps_done / self.total_steps, 4) if self.total_steps else None,
            "finish_estimate_at": self.finish_estimate_at(),
            "created_at": self.created_at.isoformat(),
            **self.schedule_view(),
        }

    def finish_estimate_at(self) -> float | None:
        """When a running job should finish (Unix time): its remaining steps at its step rate
        over a window of its progress (portal.jobs.eta). None while it does not run or its rate
        is not known well enough yet."""
        if self.state not in (JobState.RUNNING, JobState.RESIZING) or self.last_progress_at is None:
            return None
        left = self.total_steps - self.steps_done
        return eta.finish_estimate_at(self.step_rate, left, self.last_progress_at.timestamp())

    @property
    def step_rate(self) -> eta.StepRate:
        return eta.StepRate(self.rate_steps, self.rate_seconds)

    @property
    def workers_now(self) -> int:
        return self.allocations.count()


def listed(jobs: models.QuerySet[Job]) -> models.QuerySet[Job]:
    """`jobs` with what `Job.summary` reads fetched in the same query: the owner and the number
    of devices held. Without it a list costs a query per row, and a single job's summary reads
    its row and its devices in two statements: a new generation committed between them showed
    the old generation with the new worker count (PostgreSQL gives each statement its own
    snapshot), and a test took a resize for landed before it had begun."""
    return jobs.select_related("owner").annotate(allocation_count=models.Count("allocations"))


class Allocation(models.Model):
    """A device given to a job for the job's current generation; `rank` orders its workers."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations")
    device = models.OneToOneField(Device, on_delete=models.CASCADE, related_name="allocation")
    rank = models.PositiveIntegerField()
    generation = models.PositiveIntegerField()

    class Meta:
        ordering = ["job", "rank"]
        constraints = [models.UniqueConstraint(fields=["job", "rank"], name="allocation_unique_rank")]


class Worker(models.Model):
    """One worker process in one generation, as its agent reported it. A survivor of a resize
    has a row per generation, all with its one pid: the older ones are `switched`."""

    class State(models.TextChoices):
        RUNNING = "running"
        SWITCHED = "switched"
        """The process went on into a newer generation (it has a newer row)."""
        EXITED = "exited"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="workers")
    generation = models.PositiveIntegerField()
    rank = models.PositiveIntegerField()
    node = models.ForeignKey(
        Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="workers",
        help_text="null once its node, a drained pool node, was pruned (portal.cluster.pool_nodes)",
    )
    node_name = models.CharField(max_length=100, help_text="its node's name, which outlives a pruned node")
    device = models.ForeignKey(
        Device,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="workers",
        help_text="the device it runs on; null if its node never registered the index it reported",
    )
    device_index = models.PositiveIntegerField(
        help_text="the device index its agent reported (the API shows it)"
    )
    pid = models.PositiveIntegerField(null=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.RUNNING)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=20, blank=True)
    started_at = models.DateTimeField(default=timezone.now)
    joined_at = models.DateTimeField(
        null=True, blank=True, help_text="when its generation's group formed; null while it warms up"
    )
    exited_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "generation", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["job", "generation", "rank"], name="worker_unique_rank")
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.node_name and self.node is not None:
            self.node_name = self.node.name
        super().save(*args, **kwargs)


class Generation(models.Model):
    """One membership generation of a job and where it is in its life (the phases, their
    transitions and deadlines: elastic.membership.GenerationPhase). Written only by
    portal.jobs.lifecycle."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="generations")
    number = models.PositiveIntegerField()
    phase = models.CharField(
        max_length=12, choices=[(p.value, p.value) for p in GenerationPhase], default=GenerationPhase.PLANNED.value
    )
    reason = models.CharField(max_length=40, help_text="why it was planned")
    deadline_at = models.DateTimeField(null=True, blank=True, help_text="when its current phase expires")
    planned_at = models.DateTimeField(default=timezone.now)
    published_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True, help_text="when every joiner was seen ready")
    formed_at = models.DateTimeField(null=True, blank=True)
    settled_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    excluded_devices = models.JSONField(
        default=list, blank=True,
        help_text="ids of devices whose worker died or never got ready: the next plan leaves them out if it can",
    )
    end_reason = models.CharField(max_length=40, blank=True, help_text="lost/expired: why, for the next resize")
    note = models.TextField(blank=True, help_text="what happened, for people")

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="generation_unique_number")]

    def __str__(self) -> str:
        return f"job {self.job_id} generation {self.number} ({self.phase})"


class ResizeEvent(models.Model):
    """One change of a job's membership: what it was, what it became, and what it cost."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="resizes")
    generation = models.PositiveIntegerField()
    reason = models.CharField(max_length=40)
    workers_before = models.PositiveIntegerField()
    workers_after = models.PositiveIntegerField()
    devices_before = models.JSONField(default=list)
    devices_after = models.JSONField(default=list)
    requested_at = models.DateTimeField(
        default=timezone.now, help_text="when it was asked for: the pin's request for a manual resize, else the plan"
    )
    requested_by = models.CharField(max_length=150, blank=True, help_text="who asked for a manual resize")
    completed_at = models.DateTimeField(
        null=True, blank=True, help_text="the first step of the new generation: landed"
    )
    pause_s = models.FloatField(
        null=True, blank=True, help_text="last step end before to first step end after, less a normal step"
    )
    step = models.PositiveIntegerField(null=True, blank=True, help_text="completed steps at the switch")
    members_before = models.JSONField(default=list, help_text="the workers' own view: node/device_index")
    members_after = models.JSONField(default=list)
    bytes_moved = models.BigIntegerField(null=True, blank=True, help_text="state bytes the joiners received")
    phases = models.JSONField(default=dict, help_text="seconds per phase of the switch")

    class Meta:
        ordering = ["job", "generation"]
        constraints = [
            models.UniqueConstraint(fields=["job", "generation"], name="resize_unique_generation")
        ]


class JobMetric(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    generation = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    epoch = models.FloatField(null=True)
    loss = models.FloatField(null=True)
    samples_per_s = models.FloatField(null=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="the task's named training metrics")
    at = models.DateTimeField()

    class Meta:
        ordering = ["job", "at"]
        # A job's curve is read by step (portal.jobs.curves), and ingest's replay check looks
        # for a step at or past the one reported.
        indexes = [models.Index(fields=["job", "step"], name="jobmetric_job_step")]


class JobEvaluation(models.Model):
    """The task's evaluation over its eval_data after `step` steps (rank 0 reports it)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="evaluations")
    step = models.PositiveIntegerField()
    metrics = models.JSONField()
    at = models.DateTimeField()

    class Meta:
        ordering = ["job", "step", "at"]


class JobLog(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="logs")
    generation = models.PositiveIntegerField()
    rank = models.PositiveIntegerField()
    at = models.DateTimeField()
    line = models.TextField()

    class Meta:
        ordering = ["job", "at", "id"]
        # The API pages a job's log by id; pruning keeps a job's newest lines by id.
        indexes = [models.Index(fields=["job", "id"], name="joblog_job_id")]


class CodeUpload(models.Model):
    """Someone uploaded this code (stored once per digest under settings.BUNGEE.code_dir): they, and
    staff, may run and download it."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="code_uploads")
    digest = models.CharField(max_length=64, db_index=True, help_text="sha256 of the canonical tar.gz")
    size = models.PositiveBigIntegerField(help_text="bytes of the canonical tar.gz")
    files = models.JSONField(default=list, help_text="the paths it holds")
    uploaded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "digest"], name="one_upload_row_per_owner_and_digest")]


class JobArtifacts(models.Model):
    """A job's model, checkpoint and manifest (elastic.worker.artifacts), as its rank 0's agent
    handed them over when the job ended; the files are under settings.BUNGEE.artifact_dir/job-N."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="artifacts")
    step = models.PositiveIntegerField(help_text="the steps trained when they were written")
    ended = models.CharField(max_length=12, help_text="completed or stopped")
    manifest = models.JSONField()
    files = models.JSONField(help_text="name -> {size, sha256}")
    node = models.CharField(max_length=100, help_text="the node that sent them")
    stored_at = models.DateTimeField(default=timezone.now)

