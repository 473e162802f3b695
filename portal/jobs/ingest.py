"""Worker events from the agents' reports, translated: lifecycle events (started, joined,
resized, exited, form_failed) become calls of portal.jobs.lifecycle; progress, logs and step
times become metrics, log lines and the live data the scheduler's straggler check reads; an
environment report becomes the job's own packages."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import F

from elastic.wire import WorkerEvent
from portal.cluster.models import Node, ReportRefusals
from portal.jobs import lifecycle
from portal.jobs.models import Job, JobEvaluation, JobLog, JobMetric, ResizeEvent
from portal.live import broadcast
from portal.redis import client, key

log = logging.getLogger(__name__)

LOG_LINE_LIMIT = 2000
SERVICE_GAP_CAP_S = 10.0
STEP_TIMES_TTL_S = 30


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


@dataclass(frozen=True)
class Refused:
    """A worker event the portal did not take, and why."""

    index: int
    """Where it was in the events given."""
    reason: ReportRefusals.Reason
    message: str


def not_its_worker(node: Node, job_id: int, generation: int, rank: int, device_index: int | None, pid: int | None,
                   held: dict[int, int], pids: dict[int, int]) -> str | None:
    """Why the worker (`job_id`, `generation`, `rank`, on `device_index`, as `pid`) is not one the
    portal placed on `node`, or None if it is: `held` is lifecycle.ranks_held of that generation
    (rank -> device index), `pids` lifecycle.bound_pids (rank -> the pid its first report bound).
    An index or pid left out (None) is not compared."""
    what = f"rank {rank} of job {job_id}'s generation {generation}"
    if rank not in held:
        return f"node {node.name} does not hold {what}"
    if device_index is not None and device_index != held[rank]:
        return f"{what} is on device {held[rank]} of node {node.name}, not {device_index}"
    if pid is not None and pids.get(rank, pid) != pid:
        return f"{what} is pid {pids[rank]} (its first report), not {pid}"
    return None


def ingest_events(node: Node, events: list[WorkerEvent]) -> list[Refused]:
    """Takes each event whose worker `node` holds (portal.jobs.lifecycle.ranks_held: the plan of
    the event's generation put its rank on one of the node's devices, the one the event names if
    it names one; and the pid it names, if it names one, is the one that worker reported first);
    refuses the others, and those about a job that does not exist. A node speaks only for its
    own workers: another node's progress, log lines, evaluations or exits are never its to
    report, nor is a process other than the worker's. Returns the refused, in order."""
    refused: list[Refused] = []
    held: dict[tuple[int, int], dict[int, int]] = {}
    for index, event in enumerate(events):
        handler = _HANDLERS.get(event.kind)
        if handler is None:  # the worker-to-agent kinds (exiting, artifacts) stay on the node
            refused.append(Refused(index, ReportRefusals.Reason.INVALID, f"kind: a report carries no {event.kind!r} event"))
            continue
        job = Job.objects.select_related("owner").filter(pk=event.job_id).first()
        if job is None:
            refused.append(Refused(index, ReportRefusals.Reason.UNKNOWN_JOB, f"no job {event.job_id}"))
            continue
        ranks = held.get((job.pk, event.generation))
        if ranks is None:
            ranks = held[job.pk, event.generation] = lifecycle.ranks_held(node, job.pk, event.generation)
        # Read for each event: an earlier event of this report may have bound a pid.
        pids = lifecycle.bound_pids(job.pk, event.generation) if event.pid is not None and ranks else {}
        why = not_its_worker(node, job.pk, event.generation, event.rank, event.device_index, event.pid, ranks, pids)
        if why is not None:
            refused.append(Refused(index, ReportRefusals.Reason.NOT_ITS_WORKER, why))
            continue
        handler(node, job, event)
    if refused:
        log.warning("node %s: refused %d worker event(s), the first: %s", node.name, len(refused), refused[0].message)
    return refused


def _service_since_last_report(job: Job, generation: int, at: datetime) -> float:
    """Device-seconds the job trained since its previous progress report: the generation's
    world size times the time between (capped, so that a queued stretch does not count)."""
    if job.last_progress_at is None:
        return 0.0
    seconds = min(max((at - job.last_progress_at).total_seconds(), 0.0), SERVICE_GAP_CAP_S)
    workers = (
        ResizeEvent.objects.filter(job=job, generation=generation).values_list("workers_after", flat=True).first()
    )
    return seconds * (workers or 0)


def _rate_after(job: Job, step: int, at: datetime) -> dict[str, float]:
    """The job's step rate (portal.jobs.eta) once it reported `step` at `at`, as Job's fields."""
    rate = job.step_rate
    if job.last_progress_at is not None:
        rate = rate.after(step - job.steps_done, (at - job.last_progress_at).total_seconds())
    return {"rate_steps": rate.steps, "rate_seconds": rate.seconds}


def _on_progress(node: Node, job: Job, event: WorkerEvent) -> None:
    at = _at(event.at)
    # Agents deliver at least once: one that took its workers back re-reads their output from
    # the offset it last recorded, and the portal may already have what follows it. A report of
    # a step the job has for that generation is such a replay, and changes nothing.
    if JobMetric.objects.filter(job=job, generation=event.generation, step__gte=event.step or 0).exists():
        return
    # Survivors report under the generation they train in, which lags the newest one while
    # joiners warm up; a report of a generation older than the one that formed is late.
    reported: dict[str, Any] = {
        "steps_done": event.step or 0,
        "last_loss": event.loss,
        "samples_per_s": event.samples_per_s,
        "global_batch": event.global_batch,
        "learning_rate": event.lr,
        "last_progress_at": at,
        **_rate_after(job, event.step or 0, at),
    }
    updated = Job.objects.filter(pk=job.pk, active_generation__lte=event.generation).update(
        **reported,
        attained_service_s=F("attained_service_s") + _service_since_last_report(job, event.generation, at),
    )
    if updated != 1:
        return
    for name, value in reported.items():
        setattr(job, name, value)
    JobMetric.objects.create(
        job=job,
        generation=event.generation,
        step=event.step or 0,
        epoch=event.epoch,
        loss=event.loss,
        samples_per_s=event.samples_per_s,
        metrics=event.metrics or {},
        at=at,
    )
    broadcast.send(
        broadcast.job_group(job.pk),
        {
            "type": "progress",
            "job_id": job.pk,
            "generation": event.generation,
            "step": event.step,
            "total_steps": event.total_steps or job.total_steps,
            "epoch": event.epoch,
            "loss": event.loss,
            "samples_per_s": event.samples_per_s,
            "global_batch": event.global_batch,
            "learning_rate": event.lr,
            "metrics": event.metrics or {},
            "at": event.at,
            "finish_estimate_at": job.finish_estimate_at(),
        },
    )
    broadcast.send(
        broadcast.CLUSTER_GROUP,
        {"type": "job_progress", "job_id": job.pk, "steps_done": event.step, "total_steps": job.total_steps,
         "finish_estimate_at": job.finish_estimate_at()},
    )


def step_times_key(job_id: int, generation: int, rank: int) -> str:
    """Redis key of a rank's latest compute times per step (portal.scheduling.snapshot reads it)."""
    return key("job", job_id, "step-times", generation, rank)


def _on_step_times(node: Node, job: Job, event: WorkerEvent) -> None:
    """A rank's latest compute times per step: kept in Redis (live data, not history) for the
    scheduler's straggler check."""
    client().set(
        step_times_key(job.pk, event.generation, event.rank),
        json.dumps(event.step_times or []),
        ex=STEP_TIMES_TTL_S,
    )


def _on_log(node: Node, job: Job, event: WorkerEvent) -> None:
    line = (event.message or "")[:LOG_LINE_LIMIT]
    row = JobLog.objects.create(
        job=job, generation=event.generation, rank=event.rank, at=_at(event.at), line=line
    )
    broadcast.send(
        broadcast.job_group(job.pk),
        {
            "type": "log",
            "id": row.pk,
            "job_id": job.pk,
            "rank": event.rank,
            "generation": event.generation,
            "line": line,
            "at": event.at,
        },
    )


def _on_evaluation(node: Node, job: Job, event: WorkerEvent) -> None:
    metrics = {str(name)[:100]: float(value) for name, value in (event.metrics or {}).items()}
    JobEvaluation.objects.create(job=job, step=event.step or 0, metrics=metrics, at=_at(event.at))
    broadcast.send(
        broadcast.job_group(job.pk),
        {"type": "evaluation", "job_id": job.pk, "step": event.step, "metrics": metrics, "at": event.at},
    )


def _on_environment(node: Node, job: Job, event: WorkerEvent) -> None:
    """Keeps the job's own packages as the node that built (or found) its environment says
    (bounded by elastic.wire.OwnPackages), with that node's name."""
    if event.own_packages is not None:
        Job.objects.filter(pk=job.pk).update(own_packages={**event.own_packages.model_dump(mode="json"),
                                                           "node": node.name})


def _on_form_failed(node: Node, job: Job, event: WorkerEvent) -> None:
    _on_log(node, job, event)
    lifecycle.form_failed(node, job, event)


_HANDLERS: dict[str, Callable[[Node, Job, WorkerEvent], None]] = {
    "started": lifecycle.worker_started,
    "joined": lifecycle.worker_joined,
    "resized": lifecycle.generation_reported,
    "exited": lifecycle.worker_exited,
    "form_failed": _on_form_failed,
    "progress": _on_progress,
    "log": _on_log,
    "step_times": _on_step_times,
    "evaluation": _on_evaluation,
    "environment": _on_environment,
}
