"""What people do to jobs: submit, resize, cancel. Views and the API call these; each one
validates fully before it stores anything, and asks the scheduler to run once it has."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from elastic.scheduling.api import Reason
from elastic.spec import FieldError, JobSpec, SpecError, validate_spec
from elastic.wording import counted
from portal.cluster.models import Device, Node
from portal.errors import ApiError, conflict
from portal.jobs import artifacts, lifecycle
from portal.jobs.code import check_usable, upload_for
from portal.jobs.models import Job
from portal.jobs.states import ACTIVE_STATES
from portal.live import broadcast
from portal.trigger import request_pool_pass, request_schedule


def check_spec(owner: User, data: Any, code_uploaded: bool = True) -> JobSpec:
    """The validated spec that `owner` may submit. Raises ApiError 400 listing every bad field,
    then for code `owner` cannot use or whose module lacks the entrypoint's class, or for an
    `init_from` that is not theirs. `code_uploaded` False (a dry run before the upload) leaves
    out the checks that need the code."""
    try:
        spec = validate_spec(data)
    except SpecError as exc:
        raise ApiError(400, "invalid_spec", f"the job spec has {counted(len(exc.errors), 'invalid field')}", exc.errors) from exc
    if spec.code is not None and spec.entrypoint is not None and code_uploaded:
        check_usable(owner, spec.code, spec.entrypoint)
    if spec.init_from is not None:
        artifacts.check_init_from(owner, spec.init_from)
    return spec


def submit_job(owner: User, data: Any) -> Job:
    """Validate a spec (`check_spec`) and store the job, queued. Raises ApiError 400."""
    spec = check_spec(owner, data)
    with transaction.atomic():
        job = lifecycle.create_job(owner, spec)
        broadcast.job_changed(job)  # sent once the job is committed
    return job


def dry_run(owner: User, data: Any) -> tuple[JobSpec, bool]:
    """Checks a spec as `submit_job` would, storing nothing: returns the validated spec and
    whether its code (if it names any) is already uploaded and usable by `owner` (then its
    entrypoint is checked too; if not, the caller uploads it and submits). Raises ApiError 400."""
    spec = check_spec(owner, data, code_uploaded=False)
    uploaded = spec.code is not None and upload_for(owner, spec.code) is not None
    if uploaded and spec.code is not None and spec.entrypoint is not None:
        check_usable(owner, spec.code, spec.entrypoint)
    return spec, uploaded


def usable_devices() -> QuerySet[Device]:
    """Devices a job can be given: present, not taken by their owner, their node online (as
    Device.usable)."""
    return Device.objects.filter(present=True, owner_present=False, node__state=Node.State.ONLINE)


def usable_device_count() -> int:
    return usable_devices().count()


def request_resize(job: Job, workers: int | None, by: User) -> Job:
    """Pin the job to `workers` workers (None lifts the pin), as `by` asks. Raises ApiError 400
    for a count outside [min, max] or above the cluster's usable devices, 409 for a job that has
    ended."""
    if job.state not in ACTIVE_STATES:
        raise conflict(f"job {job.pk} is {job.state}; only a queued or running job can be resized")
    if workers is not None:
        if not job.min_workers <= workers <= job.max_workers:
            raise ApiError(
                400, "invalid_resize",
                f"workers must be between the job's min_workers ({job.min_workers}) and max_workers ({job.max_workers})",
                [FieldError("workers", f"must be in [{job.min_workers}, {job.max_workers}]", workers)],
            )
        capacity = usable_device_count()
        if workers > capacity:
            raise ApiError(
                400, "invalid_resize",
                f"the cluster has only {capacity} usable devices",
                [FieldError("workers", f"must be at most {capacity}, the usable devices", workers)],
            )
    fields: dict[str, Any] = {"pinned_workers": workers, "pin_problem": "",
                              "pin_requested_by": by.get_username(), "pin_requested_at": timezone.now()}
    if workers is None:  # what the scheduler said of the pin no longer holds; the next cycle says more
        pin_reasons = {str(Reason.PINNED), str(Reason.PIN_UNMET)}
        fields["schedule_reasons"] = [r for r in job.schedule_reasons if r not in pin_reasons]
        if job.pinned_workers is not None:
            fields["schedule_note"] = "pin lifted: the scheduler sizes the job at its next cycle"
    with transaction.atomic():
        Job.objects.filter(pk=job.pk).update(**fields)
        request_schedule(f"job {job.pk} resize to {workers}")
        if workers is not None and workers > job.allocations.count():
            request_pool_pass(f"job {job.pk} resize to {workers}")
    job.refresh_from_db()
    return job


def cancel_job(job: Job) -> Job:
    """Cancel a queued or running job: its devices are freed and its workers stopped. Raises
    ApiError 409 if it has already ended."""
    if job.state not in ACTIVE_STATES or not lifecycle.cancel(job):
        job.refresh_from_db()
        raise conflict(f"job {job.pk} is already {job.state}")
    return job
