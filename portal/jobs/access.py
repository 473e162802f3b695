"""Every lookup of a job for a person goes through here. Everyone logged in may see that a job
exists and which devices it holds (the cluster board, like `squeue`); its details, logs and
actions belong to its owner and to staff."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser, User

from portal.errors import ApiError, forbidden, not_found
from portal.jobs.models import Job, listed


def may_manage(user: User | AnonymousUser, job: Job) -> bool:
    """Whether `user` may read the job's details and act on it."""
    return bool(user.is_authenticated and (job.owner_id == user.pk or user.is_staff))


def job_for(user: User | AnonymousUser, job_id: int) -> Job:
    """The job, if `user` may manage it. Raises ApiError 404 if there is no such job and 403 if
    it belongs to someone else."""
    if not user.is_authenticated:
        raise ApiError(401, "unauthenticated", "log in or send an API token")
    job = listed(Job.objects.filter(pk=job_id)).first()  # its row and its worker count at one instant
    if job is None:
        raise not_found(f"job {job_id}")
    if not may_manage(user, job):
        raise forbidden(f"job {job_id} belongs to {job.owner.get_username()}; only its owner and staff may do that")
    return job
