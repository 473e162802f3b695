"""The life of a job and of its membership generations, in the database. This module is the only
writer of `Job.state`, of the job's generation fields (`generation`, `active_generation`,
`restarts`, `master_port`), of `Generation`, `Allocation` and `Worker` rows. Everything else
asks it: the scheduling cycle hands it a plan (`plan`), the agents' reports are translated into
its calls (portal.jobs.ingest), people's actions come through portal.jobs.services, and the tick
calls `expire_overdue` and `nodes_lost`. What it decides to send goes through portal.dispatch.

A generation's phases, their transitions and what each deadline means are in
elastic.membership.GenerationPhase. The deadlines, from the settings:

    PUBLISH_TIMEOUT_S  planned -> published: the job's stopping workers must have exited
    WARMUP_TIMEOUT_S   published, a joiner not ready yet: its start-up (import torch, build the
                       model) must end; doubled for each generation of the job in a row that
                       expired for it, up to WARMUP_BACKOFF_MAX times (a machine too loaded to
                       start a worker in time would otherwise expire every try alike); also
                       the bound of a generation whose joiners the portal cannot tell (no
                       record on the board, or one whose members are not as many as the
                       generation's allocations), which is never taken for ready
    FORM_TIMEOUT_S     published, every joiner ready (or none): the group must form
    SETTLE_TIMEOUT_S   formed -> settled: the leavers must be gone and rank 0 must report

A generation past its deadline is expired (settled, for a formed one whose leavers are then
stopped) and the job is planned again from the members that are alive. Each passing deadline
leaves a line in the job's log and message, so the job page says what happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from elastic.artifacts import run_dir_name
from elastic.membership import GenerationPhase, check_phase_transition
from elastic.membership.compose import Seat, compose_membership
from elastic.spec import JobSpec
from elastic.wire import (
    ExportCommand,
    LaunchCommand,
    Membership,
    RunningWorker,
    WorkerAssignment,
    WorkerEvent,
)
from elastic.wording import counted
from portal import dispatch, redis_users
from portal.cluster.devices import ClusterDevices, device_id, node_of
from portal.cluster.models import Device, Node
from portal.jobs.heartbeats import beating, tell_to_leave
from portal.jobs.models import (
    Allocation,
    Generation,
    Job,
    JobArtifacts,
    JobLog,
    JobMetric,
    ResizeEvent,
    Worker,
)
from portal.jobs.restarts import RestartBudget
from portal.jobs.states import ACTIVE_STATES, FINAL_STATES, JobState
from portal.live import broadcast
from portal.trigger import request_pool_pass, request_schedule, request_schedule_at

log = logging.getLogger(__name__)

MASTER_PORT_SPAN = 5000
_OPEN_PHASES = [p.value for p in GenerationPhase if not p.final]


def _deadline(timeout_s: float) -> datetime:
    return timezone.now() + timedelta(seconds=timeout_s)


WARMUP_BACKOFF_MAX = 8
NEVER_READY = "a joiner never got ready"
USER_TRACEBACK_CHARS = 1500
"""How much of the traceback of the job's own files a failed job's message quotes (its innermost part)."""


def warmup_timeout_s(job: Job) -> float:
    """The warm-up deadline of the job's next published generation: WARMUP_TIMEOUT_S, doubled
    for each of its latest tries in a row that expired waiting for a joiner, at most
    WARMUP_BACKOFF_MAX times that. A job that can train without the joiner's device trains on
    between two tries, in a generation planned without it: such a generation (no joiner, ended
    without trouble within the longest deadline) is the pause between tries, not a try that
    worked (counting it as one gave every try of a loaded machine the plain deadline). A
    generation whose joiners got ready breaks the run."""
    base = settings.BUNGEE.warmup_timeout_s
    between_tries_s = base * WARMUP_BACKOFF_MAX
    factor = 1
    earlier = Generation.objects.filter(job=job, number__lt=job.generation).order_by("-number")
    for number, end_reason, planned_at, ended_at in earlier.values_list(
        "number", "end_reason", "planned_at", "ended_at"
    )[: 2 * WARMUP_BACKOFF_MAX]:
        if factor >= WARMUP_BACKOFF_MAX:
            break
        if end_reason == NEVER_READY:
            factor *= 2
        elif (end_reason or ended_at is None or (ended_at - planned_at).total_seconds() >= between_tries_s
              or _had_joiners(job, number)):
            break
    return base * factor


def _had_joiners(job: Job, number: int) -> bool:
    """Whether generation `number` of `job` started a worker its previous generation did not have."""
    before = Worker.objects.filter(job=job, generation=number - 1, pid__isnull=False).values("pid")
    return Worker.objects.filter(job=job, generation=number).exclude(pid__in=before).exists()


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


# --- reading -------------------------------------------------------------------------------------


def current(job: Job) -> Generation | None:
    """The job's newest generation, or None before its first plan."""
    return Generation.objects.filter(job=job, number=job.generation).first()


def newest_generations(job_ids: Iterable[int]) -> dict[int, Generation]:
    """Per job of `job_ids` that has been planned, its newest generation. Reads one row per
    job, the one numbered as the job's `generation` (plan writes both in one transaction), not
    the job's earlier generations."""
    rows = Generation.objects.filter(job_id__in=list(job_ids), number=F("job__generation"))
    return {row.job_id: row for row in rows.order_by("job_id")}


def needs_replan(generation: Generation | None) -> bool:
    """Whether a job whose newest generation is `generation` must be planned again even if its
    devices do not change (a member died, or the generation expired)."""
    return generation is not None and GenerationPhase(generation.phase).needs_replan


def leavers(job: Job) -> list[Worker]:
    """The job's running workers on devices its newest generation does not hold."""
    allocated = set(job.allocations.values_list("device_id", flat=True))
    running = Worker.objects.filter(job=job, state=Worker.State.RUNNING).select_related("node")
    return [row for row in running if row.device_id not in allocated]


def resize_in_flight(
    generation: Generation | None, allocated: Collection[int], running: Iterable[int | None]
) -> bool:
    """Whether a job's newest generation `generation` is on its way to forming, or formed but a
    leaver is still on its way out (so that no newer plan takes it for a survivor). `allocated`:
    the devices the job holds; `running`: the devices of its running workers (None: a device its
    node never registered), as the scheduling cycle read them."""
    if generation is not None and GenerationPhase(generation.phase).in_flight and allocated:
        return True  # a generation of no devices (the job waits for some) has nothing to form
    return any(device not in allocated for device in running)


def live_workers(job_id: int) -> dict[tuple[int, int], Worker]:
    """The job's running worker processes by (node id, device index): one row each, the newest."""
    rows = Worker.objects.filter(job_id=job_id, state=Worker.State.RUNNING).select_related("node")
    return {(row.node_id, row.device_index): row for row in rows.order_by("generation") if row.node_id is not None}


def ranks_held(node: Node, job_id: int, generation: int) -> dict[int, int]:
    """The ranks of job `job_id`'s generation `generation` that `node` holds, each with the index
    of the node's device the generation's plan placed it on (its resize record names each rank's
    device, in rank order). A node speaks for these workers only. Empty for a generation never
    planned."""
    planned = (
        ResizeEvent.objects.filter(job_id=job_id, generation=generation).values_list("devices_after", flat=True).first()
    )
    held = {}
    for rank, device in enumerate(planned or []):
        index = device.rpartition("/")[2]
        if node_of(device) == node.name and index.isdigit():
            held[rank] = int(index)
    return held


def bound_pids(job_id: int, generation: int) -> dict[int, int]:
    """rank -> pid of the workers of job `job_id`'s generation `generation` that reported one: the
    first report of a worker binds its pid, and a report of another pid for that rank is not
    its worker's."""
    rows = Worker.objects.filter(job_id=job_id, generation=generation, pid__isnull=False)
    return {rank: pid for rank, pid in rows.values_list("rank", "pid") if pid is not None}


def allocation_rows() -> list[dict[str, Any]]:
    """Every device held by a job, for the board."""
    return [
        {"device_id": a.device_id, "job_id": a.job_id, "rank": a.rank, "generation": a.generation}
        for a in Allocation.objects.all()
    ]


def run_dir(job: Job) -> str:
    """The job's checkpoint directory. Named by id and submission time, so that a database
    that starts over (ids reused) never resumes a job from another job's checkpoint."""
    return f"{settings.BUNGEE.run_dir}/{run_dir_name(job.pk, f'{job.created_at:%Y%m%dT%H%M%S%f}')}"


# --- writing: phases -----------------------------------------------------------------------------


def move_phase(generation: Generation, target: GenerationPhase, **fields: Any) -> bool:
    """Moves `generation` to `target` if it is still in the phase this object holds (a
    conditional UPDATE), setting `fields`. Returns whether this call moved it. Raises
    InvalidPhaseTransition for a move the phases do not allow."""
    check_phase_transition(generation.phase, target)
    if target.final:
        fields.setdefault("ended_at", timezone.now())
        fields.setdefault("deadline_at", None)
    changed = Generation.objects.filter(pk=generation.pk, phase=generation.phase).update(phase=target, **fields)
    if changed == 1:
        generation.phase = target
        for name, value in fields.items():
            setattr(generation, name, value)
        _wake_scheduler(generation)
    return changed == 1


def _wake_scheduler(generation: Generation) -> None:
    """The scheduler runs when a generation's phase asks for it, not only on the beat's tick: once
    it settles (a job waits for its resize in flight to settle before it may grow or shrink
    again, and a device it or a leaver gave up may go to another job), and at its deadline,
    if it has one (a joiner that never gets ready, a group that never forms, a leaver that
    lingers)."""
    what = f"job {generation.job_id}: generation {generation.number}"
    if generation.phase == GenerationPhase.SETTLED:
        request_schedule(f"{what} settled")
    if generation.deadline_at is not None:
        request_schedule_at(f"{what} {generation.phase} past its deadline", generation.deadline_at)


def _log(job: Job, generation: int, message: str) -> None:
    """A line of the platform's own in the job's log (the job page shows it live)."""
    row = JobLog.objects.create(job=job, generation=generation, rank=0, at=timezone.now(), line=message)
    broadcast.send(
        broadcast.job_group(job.pk),
        {"type": "log", "id": row.pk, "job_id": job.pk, "rank": 0, "generation": generation,
         "line": message, "at": row.at.timestamp()},
    )


def _end_generation(job: Job, target: GenerationPhase, end_reason: str, note: str,
                    excluded: Iterable[int] = ()) -> bool:
    """Moves the job's newest generation, if still open, to `target` (lost or expired), with the
    devices the next plan should leave out; logs `note` and asks the scheduler to plan again.
    Returns whether it moved (False: it had ended already; the devices are still added)."""
    generation = current(job)
    if generation is None:
        return False
    devices = sorted({*generation.excluded_devices, *excluded})
    if GenerationPhase(generation.phase).final:
        Generation.objects.filter(pk=generation.pk).update(excluded_devices=devices)
        return False
    moved = move_phase(generation, target, excluded_devices=devices, end_reason=end_reason[:40], note=note)
    if moved:
        log.warning("job %s: %s", job.pk, note)
        _log(job, generation.number, note)
        Job.objects.filter(pk=job.pk).update(message=note)
        request_schedule(f"job {job.pk}: generation {generation.number} {target}")
    return moved


def _maybe_settle(job: Job, generation: Generation, note: str = "") -> None:
    """A formed generation settles once rank 0 reported the resize and no leaver is left."""
    if generation.phase != GenerationPhase.FORMED or leavers(job):
        return
    reported = ResizeEvent.objects.filter(job=job, generation=generation.number, completed_at__isnull=False)
    if reported.exists() or note:
        move_phase(generation, GenerationPhase.SETTLED, settled_at=timezone.now(), deadline_at=None, note=note)


# --- jobs ----------------------------------------------------------------------------------------


def create_job(owner: User, spec: JobSpec) -> Job:
    """Stores a validated job, queued, and asks the scheduler to run."""
    job = Job.objects.create(
        owner=owner,
        name=spec.name,
        workload=spec.task_name,
        code=spec.code or "",
        spec=spec.model_dump(mode="json"),
        min_workers=spec.min_workers,
        max_workers=spec.max_workers,
        priority=spec.priority,
        consistency=spec.consistency,
        total_steps=spec.total_steps(),
        message="waiting for the scheduler",
    )
    request_schedule(f"job {job.pk} submitted")
    request_pool_pass(f"job {job.pk} submitted")
    return job


def _stop_all(job: Job, reason: str, allocated: Iterable[str] = ()) -> None:
    """Asks every node that runs a worker of the job, or holds one of its devices (`allocated`:
    a joiner launched there may not have reported that it started yet), to stop them all."""
    nodes = Worker.objects.filter(job=job, state=Worker.State.RUNNING).values_list("node__name", flat=True)
    dispatch.stop(job.pk, {*nodes, *allocated}, job.generation + 1, reason)


def _end(job: Job, target: JobState, stop_reason: str, **fields: Any) -> bool:
    """Moves an active job to a final state: its devices are freed, its newest generation ends
    and its workers are asked to stop. Returns whether this call ended it."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ACTIVE_STATES:
            return False
        # The scheduler's reasons were about a job it still planned for: a finished job has none.
        done = {"schedule_reasons": [], "schedule_note": "", "pin_problem": "", "queue": {}}
        if not locked.claim(target, finished_at=timezone.now(), **done, **fields):
            return False
        allocated = set(locked.allocations.values_list("device__node__name", flat=True))
        locked.allocations.all().delete()
        generation = current(locked)
        if generation is not None and not GenerationPhase(generation.phase).final:
            move_phase(generation, GenerationPhase.ENDED)
        request_schedule(f"job {job.pk} {target}")
    _stop_all(locked, stop_reason, allocated)
    _remove_redis_user_once_stopped(locked)
    if target == JobState.FAILED:
        _ask_for_export(locked)
    broadcast.job_changed(locked)
    broadcast.allocation_changed(allocation_rows())
    job.refresh_from_db()
    return True


def _remove_redis_user_once_stopped(job: Job) -> None:
    """Removes an ended job's Redis user once none of its workers runs: a worker told to stop
    still uses its board until it has saved and exited (without its user it failed instead of
    stopping). Called at the end and at each exit after it; the beat's tick removes a user left
    behind by workers that never said they exited (portal.redis_users.sync)."""
    if not Worker.objects.filter(job=job, state=Worker.State.RUNNING).exists():
        redis_users.remove_job_user(job.pk)


def _ask_for_export(job: Job) -> None:
    """A job that failed after it had trained keeps what it trained: the node of its newest rank
    0, which holds the periodic checkpoint, is asked to export it (the agent waits for the job's
    workers there to exit, and names what rank 0 wrote itself if it got that far)."""
    if job.steps_done <= 0 or JobArtifacts.objects.filter(job=job).exists():
        return
    holder = Worker.objects.filter(job=job, rank=0).order_by("-generation").select_related("node").first()
    if holder is None:
        return
    dispatch.send(
        holder.node_name,
        ExportCommand(job_id=job.pk, generation=max(job.generation, 1), spec=job.spec, run_dir=run_dir(job)),
    )


def state_kept(job: Job, step: int) -> None:
    """The job's artifacts arrived, holding its state after `step` steps: that is the last step
    it applied and keeps, and `steps_done` says so on every page, list and the CLI. Progress
    reports come every few seconds, so the last one is often behind the step the job ended at; a
    failed job's state may come from an older checkpoint. The agent hands artifacts over only
    once the events before them reached the portal (agent.main), so no earlier report of rank 0
    overtakes them."""
    Job.objects.filter(pk=job.pk).update(steps_done=step)
    job.steps_done = step


def cancel(job: Job) -> bool:
    """Cancels an active job; returns whether this call did."""
    return _end(job, JobState.CANCELLED, "cancel", message="cancelled by its owner")


def finish(job: Job) -> bool:
    """A worker trained the last step: the job succeeded."""
    return _end(job, JobState.SUCCEEDED, "finished", message=f"trained all {counted(job.total_steps, 'step')}", steps_done=job.total_steps)


# --- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationPlan:
    """A new generation for one job, as the scheduling cycle decided it."""

    job_id: int
    seen_generation: int
    """The job's generation in the snapshot the plan was made from: a job that moved on since
    is left for the next cycle."""
    devices: tuple[int, ...]
    """Device ids in rank order; empty: the job waits for devices."""
    devices_before: tuple[int, ...]
    reason: str
    waiting_note: str = ""
    """What a job planned onto no devices tells its owner before "waiting for N devices" (the
    node it ran on drained, and why); empty: "waiting for devices"."""


def _pin_pending(job: Job, reason: str, previous: ResizeEvent | None) -> bool:
    """Whether a generation planned now for `reason` carries the job's pin request (who asked,
    and when: a manual resize's land time starts there): the pin has not landed yet, and the
    generation is planned for it, or again after the one planned for it (`previous`, the
    job's newest resize) expired or was lost (its group did not form, a member died) before it
    landed."""
    asked = job.pin_requested_at
    if asked is None:
        return False
    if ResizeEvent.objects.filter(job=job, requested_at=asked, completed_at__isnull=False).exists():
        return False
    return reason == "manual resize" or (previous is not None and previous.requested_at == asked)


def _free_port(job: Job, generation: int) -> int:
    base = settings.BUNGEE.master_port_base
    taken = set(
        Job.objects.filter(state__in=ACTIVE_STATES).exclude(pk=job.pk).values_list("master_port", flat=True)
    )
    offset = (job.pk * 7 + generation) % MASTER_PORT_SPAN
    for step in range(MASTER_PORT_SPAN):
        port = base + (offset + step) % MASTER_PORT_SPAN
        if port not in taken:
            return port
    raise RuntimeError(f"no free rendezvous port in [{base}, {base + MASTER_PORT_SPAN})")


def plan(
    plans: list[GenerationPlan], unblocked: Callable[[list[int]], list[int]], devices: ClusterDevices
) -> dict[int, Generation]:
    """Writes a new generation for each plan whose job nobody touched since the snapshot and
    that `unblocked` still lets through (its devices are free); `devices` names them in its
    resize record. Returns the generations written, by job id (in the order written)."""
    by_job = {p.job_id: p for p in plans}
    changed: dict[int, Generation] = {}
    with transaction.atomic():
        locked = {
            j.pk: j for j in Job.objects.select_for_update().filter(pk__in=list(by_job), state__in=ACTIVE_STATES)
        }
        fresh = unblocked(
            [job_id for job_id, p in by_job.items() if job_id in locked and locked[job_id].generation == p.seen_generation]
        )
        Allocation.objects.filter(job_id__in=fresh).delete()
        for job_id in fresh:
            changed[job_id] = _write_generation(locked[job_id], by_job[job_id], devices)
    for job_id in changed:
        if not by_job[job_id].devices:
            _stop_all(locked[job_id], "resize")
    return changed


def _landed_unreported(job: Job, number: int) -> None:
    """Generation `number`, superseded, trained before rank 0's account of its resize came (it
    is sent a few steps in, when the pace after the switch is known): the resize landed at the
    end of the generation's first step. A late account still fills in the rest."""
    first = JobMetric.objects.filter(job=job, generation=number).order_by("step").first()
    if first is not None:
        ResizeEvent.objects.filter(job=job, generation=number, completed_at__isnull=True).update(completed_at=first.at)


def _write_generation(job: Job, planned: GenerationPlan, devices: ClusterDevices) -> Generation:
    """Writes the job's next generation, its allocations and its resize record; returns it."""
    number = job.generation + 1
    before = current(job)
    if before is not None and not GenerationPhase(before.phase).final:
        move_phase(before, GenerationPhase.SUPERSEDED)
        _landed_unreported(job, before.number)
    generation = Generation.objects.create(
        job=job,
        number=number,
        reason=planned.reason[:40],
        # A job with no devices waits for them: nothing to publish, nothing to expire.
        deadline_at=_deadline(settings.BUNGEE.publish_timeout_s) if planned.devices else None,
    )
    _wake_scheduler(generation)
    Allocation.objects.bulk_create(
        Allocation(job=job, device_id=device_id, rank=rank, generation=number)
        for rank, device_id in enumerate(planned.devices)
    )
    previous = ResizeEvent.objects.filter(job=job).order_by("-generation").first()
    asked: dict[str, Any] = {}
    if _pin_pending(job, planned.reason, previous):
        asked = {"requested_at": job.pin_requested_at, "requested_by": job.pin_requested_by}
    # The workers the job runs on before this resize: those of the last one that landed. A
    # resize to some workers that never landed (expired, lost, superseded) hands its "before"
    # on; one to none needs no report to land (its workers stop).
    running = devices.keys(planned.devices_before)
    if previous is not None and previous.completed_at is None and previous.devices_after:
        running = previous.devices_before
    ResizeEvent.objects.create(
        job=job,
        generation=number,
        reason=planned.reason[:40],
        **asked,
        workers_before=len(running),
        workers_after=len(planned.devices),
        devices_before=running,
        devices_after=devices.keys(planned.devices),
    )
    fields: dict[str, Any] = {
        "generation": number,
        "master_port": _free_port(job, number) if planned.devices else None,
    }
    if not planned.devices:
        fields["message"] = (
            f"{planned.waiting_note}; waiting for {counted(job.min_workers, 'device')}"
            if planned.waiting_note else "waiting for devices"
        )
        if job.state != JobState.QUEUED:
            job.claim(JobState.QUEUED, **fields)
            request_pool_pass(f"job {job.pk} queued again: {fields['message']}")
        else:
            Job.objects.filter(pk=job.pk).update(**fields)
    elif job.state in (JobState.RUNNING, JobState.RESIZING):
        fields["message"] = f"resizing to {counted(len(planned.devices), 'worker')} ({planned.reason})"
        if job.state == JobState.RUNNING:
            job.claim(JobState.RESIZING, **fields)
        else:
            Job.objects.filter(pk=job.pk).update(**fields)
    else:
        has_workers = Worker.objects.filter(job=job, state=Worker.State.RUNNING).exists()
        waiting = " once its stopping workers are gone" if has_workers else ""
        fields["message"] = f"starting {counted(len(planned.devices), 'worker')}{waiting}"
        Job.objects.filter(pk=job.pk).update(**fields)
    return generation


# --- publishing ----------------------------------------------------------------------------------


def membership_record(job: Job, allocated: Sequence[Device], live: dict[tuple[int, int], Worker]) -> Membership:
    """The record of the job's newest generation: its devices in rank order, each member a
    joiner unless a worker that holds the state runs on its device. A worker that holds the
    state but is not a member hands it over (the donor) when no member holds it
    (elastic.membership.compose)."""
    holders = sorted((row for row in live.values() if row.joined_at is not None), key=lambda row: row.rank)
    return compose_membership(
        job.pk,
        job.generation,
        [Seat(device.node.name, device.index, device.node.address) for device in allocated],
        [Seat(row.node.name, row.device_index, row.node.address) for row in holders if row.node is not None],
        master_port=job.master_port or settings.BUNGEE.master_port_base,
        global_batch=job.batch_size if job.consistency == Job.Consistency.HYBRID else None,
    )


@dataclass(frozen=True)
class Planned:
    """A job's newest generation and its devices in rank order, as a scheduling cycle knows
    them (it planned them, or read them at its start): publish takes them from it instead of
    reading back what the cycle wrote."""

    generation: Generation
    devices: Sequence[Device]


def publish(job_id: int, planned: Planned | None = None) -> bool:
    """Publishes the job's newest generation once (planned -> published): its record on the
    board, then a launch to every node involved. A queued job waits until its old workers
    (stopping) have exited. `planned`: the generation and its devices, as a scheduling cycle
    knows them; read from the database if not given. Returns whether this call published."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None or job.state not in ACTIVE_STATES:
        return False
    if planned is None:
        rows = list(job.allocations.select_related("device__node").order_by("rank"))
        newest = current(job)
        if newest is None or any(a.generation != newest.number for a in rows):
            return False
        planned = Planned(newest, [a.device for a in rows])
    generation, devices = planned.generation, planned.devices
    if not devices or generation.number != job.generation or generation.phase != GenerationPhase.PLANNED:
        return False
    live = live_workers(job.pk)
    if job.state == JobState.QUEUED and live:
        return False
    record = membership_record(job, devices, live)
    joiners = [m for m in record.members if m.joiner]
    # Before the generation moves on: with Redis away it stays planned, published by a later call.
    workers_redis_url = redis_users.job_url(job.pk)
    with transaction.atomic():
        if not move_phase(
            generation,
            GenerationPhase.PUBLISHED,
            published_at=timezone.now(),
            deadline_at=timezone.now() + timedelta(seconds=warmup_timeout_s(job))
            if joiners
            else _deadline(settings.BUNGEE.form_timeout_s),
        ):
            return False
        if job.state == JobState.QUEUED:
            job.claim(JobState.RUNNING, started_at=job.started_at or timezone.now(), message="workers starting")
    nodes: dict[str, tuple[list[WorkerAssignment], list[int]]] = {}
    for row in live.values():
        nodes.setdefault(row.node_name, ([], []))
    for rank, device in enumerate(devices):
        starting, members = nodes.setdefault(device.node.name, ([], []))
        members.append(device.index)
        if (device.node_id, device.index) not in live:
            starting.append(WorkerAssignment(rank=rank, device_index=device.index))
    launches = {
        node_name: LaunchCommand(
            job_id=job.pk,
            generation=job.generation,
            world_size=len(devices),
            master_addr=record.master_addr,
            master_port=record.master_port,
            workers=starting,
            members=members,
            spec=job.spec,
            run_dir=run_dir(job),
            coordination_key=dispatch.board(job.pk).key,
            redis_url=workers_redis_url,
        )
        for node_name, (starting, members) in nodes.items()
    }
    dispatch.publish(record, launches)
    log.info("job %s: published generation %s on %s (%s to start)", job.pk, job.generation,
             record.keys(), sum(len(starting) for starting, _ in nodes.values()))
    broadcast.job_changed(job)
    return True


# --- what the workers report ---------------------------------------------------------------------


def _running_row(node: Node, job: Job, event: WorkerEvent, **fields: Any) -> None:
    """Writes the row of `event`'s worker in its generation as running, with `fields`."""
    index = event.device_index or 0
    Worker.objects.update_or_create(
        job=job,
        generation=event.generation,
        rank=event.rank,
        defaults={
            "node": node,
            "node_name": node.name,
            "device_id": device_id(node, index),
            "device_index": index,
            "pid": event.pid,
            "state": Worker.State.RUNNING,
            **fields,
        },
    )


def worker_started(node: Node, job: Job, event: WorkerEvent) -> None:
    """The agent spawned a joiner; it warms up."""
    _running_row(node, job, event, started_at=_at(event.at))


def worker_joined(node: Node, job: Job, event: WorkerEvent) -> None:
    """A worker formed generation `event.generation` as rank `event.rank`: a joiner that got the
    state, or a survivor that switched (its older row becomes `switched`, same pid). The first
    one to say so forms the generation (published -> formed)."""
    at = _at(event.at)
    # One transaction: a scheduling cycle must never see the worker's old row switched and its
    # new one not yet written (it would take the worker for no holder of the state).
    with transaction.atomic():
        earlier = Worker.objects.filter(
            job=job, node=node, pid=event.pid, state=Worker.State.RUNNING, generation__lt=event.generation
        )
        first = earlier.order_by("generation").first()
        earlier.update(state=Worker.State.SWITCHED)
        _running_row(node, job, event, started_at=first.started_at if first is not None else at, joined_at=at)
        Job.objects.filter(pk=job.pk, active_generation__lt=event.generation).update(
            active_generation=event.generation
        )
        generation = Generation.objects.filter(job=job, number=event.generation).first()
        if generation is not None and generation.phase == GenerationPhase.PUBLISHED:
            move_phase(
                generation,
                GenerationPhase.FORMED,
                formed_at=at,
                deadline_at=_deadline(settings.BUNGEE.settle_timeout_s),
            )


def generation_reported(node: Node, job: Job, event: WorkerEvent) -> None:
    """Rank 0's account of a generation taking over (its pause, phases, bytes moved): the
    resize is complete, and the job runs again."""
    ResizeEvent.objects.filter(job=job, generation=event.generation).update(
        completed_at=_at(event.at),
        pause_s=event.pause_s,
        step=event.step,
        members_before=event.members_before or [],
        members_after=event.members_after or [],
        bytes_moved=event.bytes_moved,
        phases=event.phases or {},
    )
    job.refresh_from_db()
    if event.generation != job.generation:
        return  # a newer generation is under way
    generation = current(job)
    if generation is not None:
        _maybe_settle(job, generation)
    message = f"running on {counted(job.allocations.count(), 'worker')}"
    if job.state == JobState.RESIZING:
        job.claim(JobState.RUNNING, message=message)
    elif job.state == JobState.RUNNING:
        Job.objects.filter(pk=job.pk).update(message=message)
    broadcast.job_changed(job)


def form_failed(node: Node, job: Job, event: WorkerEvent) -> None:
    """A member could not form its generation's group in time: if that is still the job's
    newest generation and has not formed, it expires at once."""
    number = event.failed_generation
    if number is None or number != job.generation:
        return
    generation = Generation.objects.filter(job=job, number=number).first()
    if generation is None or generation.phase != GenerationPhase.PUBLISHED:
        return
    _end_generation(
        job, GenerationPhase.EXPIRED, "its group did not form",
        f"generation {number} expired: {event.message or 'its group did not form'}; planning again",
    )


def worker_exited(node: Node, job: Job, event: WorkerEvent) -> None:
    """A worker process is gone. The last step trained and rank 0 done: the job succeeded (the
    other ranks' completed exits change nothing, rank 0 exits after its export). A crash: the newest
    generation is lost (the survivors hold the state of the last step) and the job is planned
    again without the device, if it can do without it. A worker that left although its device
    is still the job's: planned again, with a new worker there."""
    row = Worker.objects.filter(job=job, generation=event.generation, rank=event.rank).first()
    was_running = row is not None and row.state == Worker.State.RUNNING
    if event.device_index is None and row is not None:
        event = event.model_copy(update={"device_index": row.device_index})
    # The worker's device, if the event or the worker's row says which it was.
    device_index = event.device_index
    if row is not None and (row.node_id, row.device_index) == (node.pk, device_index):
        device = row.device_id
    else:
        device = device_id(node, device_index)
    Worker.objects.update_or_create(
        job=job,
        generation=event.generation,
        rank=event.rank,
        defaults={
            "node": node,
            "node_name": node.name,
            "device_id": device,
            "device_index": device_index or 0,
            "state": Worker.State.EXITED,
            "exit_code": event.exit_code,
            "reason": event.reason or "",
            "exited_at": _at(event.at),
        },
    )
    # A death matters to the job if the worker was a member of its newest generation or held
    # the state; a joiner already planned out (one that hung while warming up) does not.
    mattered = was_running and row is not None and (
        row.joined_at is not None or (device is not None and job.allocations.filter(device_id=device).exists())
    )
    if event.reason == "completed":
        # Every rank trains the last step; rank 0 then writes the job's artifacts and exits
        # last. Finishing the job on another rank's exit would stop rank 0 mid-export.
        if job.state in ACTIVE_STATES and event.rank == 0:
            finish(job)
    elif job.state in (JobState.RUNNING, JobState.RESIZING) and event.reason == "user_error":
        if row is None and event.message:
            # A worker that never started: the agent refused the job's code before it could (its
            # environment did not build); the event says why.
            message = (
                f"the job could not start on {node.name}: {_clause(event.message)}. "
                "Not restarted: the same code fails on any device"
            )
        else:
            message = _user_error_message(event)
        _end(job, JobState.FAILED, "finished", message=message)
    elif job.state in ACTIVE_STATES and mattered and event.reason == "failed":
        _worker_failed(job, event, device)
    elif (
        job.state in (JobState.RUNNING, JobState.RESIZING)
        and was_running
        and device is not None
        and device_index is not None
        and not _stopped_late_joiner(job, row, event)
    ):
        held = job.allocations.filter(device_id=device).exists()
        replaced = Worker.objects.filter(job=job, device_id=device, state=Worker.State.RUNNING).exists()
        if held and not replaced:
            _end_generation(
                job, GenerationPhase.LOST, "a worker exited",
                f"worker on {node.name}/{device_index} {event.reason} although its device is still "
                f"the job's; planning again",
            )
    if job.state in FINAL_STATES:
        _remove_redis_user_once_stopped(job)
    generation = current(job)
    if generation is not None:
        _maybe_settle(job, generation)
    publish(job.pk)


def _clause(text: str) -> str:
    """`text` without its closing period, to be followed by one: an error's own words often end
    with one (uv's causes do), and "..." would read as a cut."""
    return text.rstrip().rstrip(".")


def _user_error_message(event: WorkerEvent) -> str:
    """Why a job failed on its own code: the error its worker announced with its exit
    (event.user_error), so that the page and `bungee list` say what raised, with the traceback of
    the job's own files; the whole traceback stays in the log."""
    where = f"the job's code failed on worker rank {event.rank} of generation {event.generation}"
    failure = event.user_error
    said = f"{where}: {_clause(failure.error[:500])}." if failure and failure.error else f"{where}."
    own = failure.traceback.strip("\n") if failure else ""
    said += f"\n{own[-USER_TRACEBACK_CHARS:]}\n" if own else " "
    return said + "The whole traceback is in the log. Not restarted: the same code fails on any device"


def _stopped_late_joiner(job: Job, row: Worker | None, event: WorkerEvent) -> bool:
    """Whether `event` is the exit of a joiner the portal stopped when its generation expired
    before it was ready. The job's next generation may hold its device again (a job that cannot
    run without it); the agent starts that generation's joiner there once this one is gone, so
    its exit is no reason to plan again. Taking it for one ended each new try at once, and the
    warm-up deadline's doubling (warmup_timeout_s) with it."""
    return (
        row is not None
        and row.joined_at is None
        and event.reason == "stopped"
        and event.generation < job.generation
    )


def restart_budget() -> RestartBudget:
    return RestartBudget(
        settings.BUNGEE.max_restarts, settings.BUNGEE.restart_window_s, settings.BUNGEE.restart_healthy_s
    )


def _worker_failed(job: Job, event: WorkerEvent, device: int | None) -> None:
    """Every generation a failure ends counts once against the job's restart budget
    (portal.jobs.restarts); a spent budget fails the job."""
    what = f"worker rank {event.rank} of generation {event.generation} failed (exit code {event.exit_code})"
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.state not in ACTIVE_STATES:
            return
        first = _end_generation(
            locked, GenerationPhase.LOST, "a worker exited", f"{what}; planning again without it",
            [device] if device is not None else [],
        )
        if not first:
            return
        budget = restart_budget()
        counted = budget.charge([(at, steps) for at, steps in locked.counted_failures], event.at, locked.steps_done)
        locked.restarts += 1
        Job.objects.filter(pk=job.pk).update(restarts=locked.restarts, counted_failures=counted)
    if budget.spent(counted):
        _end(locked, JobState.FAILED, "finished", message=f"{what}; {budget.describe(counted)}")
    broadcast.job_changed(locked)


# --- nodes ---------------------------------------------------------------------------------------


def _workers_gone(rows: QuerySet[Worker], reason: str, end_reason: str, note: str) -> list[int]:
    """Marks `rows` exited with `reason`; the newest generation of each active job they served
    is lost, leaving their devices out of the next plan. Returns those jobs' ids."""
    rows = rows.filter(state=Worker.State.RUNNING)
    devices: dict[int, set[int]] = {}
    for job_id, device in rows.values_list("job_id", "device_id"):
        devices.setdefault(job_id, set()).update([device] if device is not None else [])
    rows.update(state=Worker.State.EXITED, reason=reason, exited_at=timezone.now())
    for job in Job.objects.filter(pk__in=list(devices), state__in=ACTIVE_STATES):
        _end_generation(job, GenerationPhase.LOST, end_reason, note, devices[job.pk])
    return list(devices)


@dataclass(frozen=True)
class WorkerRow:
    """A running worker as the database has it."""

    id: int
    job_id: int
    device_index: int
    pid: int | None


def workers_gone_at_registration(
    rows: list[WorkerRow], readopted: list[RunningWorker], allocated: set[tuple[int, int]]
) -> tuple[set[int], set[int]]:
    """An agent registered with the workers it re-adopted, `readopted`: returns the ids of the
    `rows` (the workers the portal thought ran on the node) that are gone, and the jobs that must
    be planned again: those that lost a worker here, and those with a device here, (job id,
    device index) in `allocated`, on which no worker runs any more (a launch sent while the
    agent was away is lost). A row is matched by job, device and pid, not by generation and
    rank, which lag by a "joined" event still on its way."""
    alive = {(worker.job_id, worker.device_index, worker.pid) for worker in readopted}
    gone = {row for row in rows if (row.job_id, row.device_index, row.pid) not in alive}
    kept = {(row.job_id, row.device_index) for row in rows if row not in gone}
    unmanned = {job_id for job_id, index in allocated if (job_id, index) not in kept}
    return {row.id for row in gone}, {row.job_id for row in gone} | unmanned


def node_registered(node: Node, adopted: list[RunningWorker]) -> None:
    """The node's agent (re)started with the workers it re-adopted: they train on; any other
    worker the portal thought ran there is gone, and each job that lost one, or has a device
    there without a worker, is planned again."""
    rows = [
        WorkerRow(*fields)
        for fields in Worker.objects.filter(node=node, state=Worker.State.RUNNING).values_list(
            "pk", "job_id", "device_index", "pid"
        )
    ]
    allocated = set(
        Allocation.objects.filter(job__state__in=ACTIVE_STATES, device__node=node).values_list(
            "job_id", "device__index"
        )
    )
    gone, replan = workers_gone_at_registration(rows, adopted, allocated)
    note = f"the agent of {node.name} restarted without some of the job's workers; planning again"
    touched = set(_workers_gone(Worker.objects.filter(pk__in=gone), "agent restart: gone", "agent restarted", note))
    for job in Job.objects.filter(pk__in=replan - touched, state__in=ACTIVE_STATES):
        _end_generation(job, GenerationPhase.LOST, "agent restarted", note)


# --- deadlines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Joiners:
    """The joiners of a job's published generation as the portal can tell them: member key ->
    device id, or, when they cannot be told, why (`unknown`; then `devices` is empty)."""

    devices: dict[str, int]
    unknown: str = ""

    def all_ready(self, ready: Collection[str]) -> bool:
        """Whether every joiner is among `ready` (true of a generation without joiners); never
        while the joiners cannot be told."""
        return not self.unknown and all(key in ready for key in self.devices)


def _joiners(job: Job, generation: Generation, record: Membership | None) -> _Joiners:
    """The joiners of the job's published generation `generation`, from its record on the board
    (`record`), which lists the members in the rank order of the generation's allocations
    (publish). They cannot be told while the board holds no record (publish writes it just after
    the phase; Redis may have lost it), nor when the record's members are not as many as the
    allocations: that mismatch is said in the log, the job's log and the generation's note once
    for each pair of counts."""
    if record is None:
        return _Joiners({}, "its membership record is not on the board")
    allocated = job.allocations.filter(generation=generation.number).order_by("rank")
    ranked = list(allocated.values_list("device_id", flat=True))
    if len(ranked) != len(record.members):
        unknown = (
            f"its membership record lists {counted(len(record.members), 'member')} "
            f"but it holds {counted(len(ranked), 'device')}"
        )
        note = f"generation {generation.number}: {unknown}; its joiners cannot be told ready"
        said = Generation.objects.filter(pk=generation.pk, phase=GenerationPhase.PUBLISHED).exclude(note=note)
        if said.update(note=note):
            log.warning("job %s: %s", job.pk, note)
            _log(job, generation.number, note)
        return _Joiners({}, unknown)
    return _Joiners(
        {member.key: device for member, device in zip(record.members, ranked, strict=True) if member.joiner}
    )


def expire_overdue() -> list[int]:
    """Ends every open generation whose phase is past its deadline (see the module docstring).
    A published one whose joiners all became ready gets the FORM deadline from then; one whose
    joiners cannot be told (see `_joiners`) is never taken for ready and expires at its WARMUP
    deadline. Returns the ids of the jobs concerned."""
    now = timezone.now()
    touched = []
    open_generations = Generation.objects.filter(
        job__state__in=ACTIVE_STATES, phase__in=_OPEN_PHASES, deadline_at__isnull=False
    ).select_related("job")
    for generation in open_generations:
        job = generation.job
        deadline_at = generation.deadline_at
        if generation.number != job.generation or deadline_at is None:  # None: filtered out above
            continue
        if generation.phase == GenerationPhase.PUBLISHED:
            board = dispatch.board(job.pk)
            joiners = _joiners(job, generation, board.record(generation.number))
            ready = board.ready(generation.number)
            if generation.ready_at is None and joiners.all_ready(ready):
                generation.deadline_at = min(deadline_at, _deadline(settings.BUNGEE.form_timeout_s))
                Generation.objects.filter(pk=generation.pk).update(ready_at=now, deadline_at=generation.deadline_at)
                _wake_scheduler(generation)
                continue
            if deadline_at > now:
                continue
            _expire_published(job, generation, joiners, ready)
        elif deadline_at <= now:
            if generation.phase == GenerationPhase.PLANNED:
                _end_generation(
                    job, GenerationPhase.EXPIRED, "stopping workers did not exit",
                    f"generation {generation.number} expired: the job's stopping workers did not exit within "
                    f"{settings.BUNGEE.publish_timeout_s:.0f} s; stopping them again",
                )
                _stop_all(job, "resize")
            elif generation.phase == GenerationPhase.FORMED:
                _settle_overdue(job, generation)
            else:
                continue
        else:
            continue
        touched.append(job.pk)
    return touched


def _expire_published(job: Job, generation: Generation, joiners: _Joiners, ready: Collection[str]) -> None:
    late = {key: device for key, device in joiners.devices.items() if key not in ready}
    if late:
        what = f"{len(late)} joiner(s) ({', '.join(sorted(late))}) not ready within {warmup_timeout_s(job):.0f} s"
        end_reason = NEVER_READY
    elif joiners.unknown and generation.ready_at is None:
        what = f"its joiners could not be told ready within {warmup_timeout_s(job):.0f} s ({joiners.unknown})"
        end_reason = "its joiners could not be told"
    else:
        what = (
            f"the group did not form within {settings.BUNGEE.form_timeout_s:.0f} s of its joiners being ready"
        )
        end_reason = "its group did not form"
    _end_generation(job, GenerationPhase.EXPIRED, end_reason,
                    f"generation {generation.number} expired: {what}; planning again without them",
                    late.values())
    stuck = list(Worker.objects.filter(job=job, state=Worker.State.RUNNING, joined_at__isnull=True)
                 .select_related("node"))
    late_devices = set(late.values())
    per_node: dict[str, list[int]] = {}
    for worker in stuck:
        if worker.device_id in late_devices:
            per_node.setdefault(worker.node_name, []).append(worker.device_index)
    dispatch.stop_devices(job.pk, per_node, generation.number + 1, "resize")


def _settle_overdue(job: Job, generation: Generation) -> None:
    """A formed generation whose leavers linger (or whose report never came) settles at its
    deadline; the leavers still running are stopped."""
    lingering = leavers(job)
    per_node: dict[str, list[int]] = {}
    for worker in lingering:
        per_node.setdefault(worker.node_name, []).append(worker.device_index)
    dispatch.stop_devices(job.pk, per_node, generation.number, "resize")
    note = (
        f"generation {generation.number} settled at its deadline "
        f"({settings.BUNGEE.settle_timeout_s:.0f} s after it formed)"
        + (f"; stopping {len(lingering)} leaver(s) still running" if lingering else "")
    )
    if move_phase(generation, GenerationPhase.SETTLED, settled_at=timezone.now(), deadline_at=None, note=note):
        _log(job, generation.number, note)


def nodes_lost() -> list[str]:
    """Nodes silent for longer than NODE_TIMEOUT_S become lost, and their workers gone, unless a
    worker of theirs still beats (portal.jobs.heartbeats): then only the agent is gone, the
    workers train on, and the node is unreachable, its workers and plan untouched, until the
    agent reports again, the heartbeats stop too, or the silence passes UNREACHABLE_TIMEOUT_S.
    Then the node is lost all the same, and the workers still beating there are told to leave
    (a job with workers elsewhere is planned again without them, which makes them leave too).
    Returns the names of the nodes this call marked lost."""
    now = timezone.now()
    deadline = now - timedelta(seconds=settings.BUNGEE.node_timeout_s)
    given_up = now - timedelta(seconds=settings.BUNGEE.unreachable_timeout_s)
    watched = (Node.State.ONLINE, Node.State.UNREACHABLE, Node.State.DRAINING)
    silent = Node.objects.filter(state__in=watched, last_seen_at__lt=deadline)
    marked = []
    for node in silent:
        running = list(
            Worker.objects.filter(node=node, state=Worker.State.RUNNING).values_list("job_id", "device_index", "pid")
        )
        alive = beating(node.name, running)
        if alive and node.last_seen_at >= given_up:
            if node.move(Node.State.UNREACHABLE, sources=(Node.State.ONLINE,)):
                log.warning("node %s: agent unreachable, its workers train on", node.name)
                broadcast.node_changed(node.name, Node.State.UNREACHABLE.value, node.last_seen_at)
            continue
        if not node.move(Node.State.LOST):
            continue
        silence_s = (now - node.last_seen_at).total_seconds()
        if alive:
            note = (f"node {node.name} lost: its agent unreachable for {silence_s:.0f} s "
                    f"(BUNGEE_UNREACHABLE_TIMEOUT_S); its workers are told to leave; planning again")
            orphans = [(job_id, index, pid) for job_id, index, pid in running if (job_id, index) in alive and pid]
            elsewhere = set(
                Worker.objects.filter(job_id__in={job_id for job_id, _, _ in orphans}, state=Worker.State.RUNNING)
                .exclude(node=node).values_list("job_id", flat=True)
            )
            tell_to_leave(node.name, [orphan for orphan in orphans if orphan[0] not in elsewhere])
        else:
            note = (
                f"node {node.name} lost: no report for {settings.BUNGEE.node_timeout_s:.0f} s; planning again"
            )
        log.warning("%s", note)
        _workers_gone(Worker.objects.filter(node=node), "node lost", "node lost", note)
        broadcast.node_changed(node.name, Node.State.LOST.value, node.last_seen_at)
        marked.append(node.name)
    if marked:
        request_pool_pass(f"node(s) {', '.join(marked[:5])} lost")
    return marked
