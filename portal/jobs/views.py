"""Pages. For now a plain job list and job page; the cluster board and the forms build on the
same services and the same live socket."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from portal.errors import ApiError
from portal.jobs.access import job_for
from portal.jobs.models import Job
from portal.jobs.states import JobState


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    jobs = Job.objects.select_related("owner").order_by("-created_at")
    state = request.GET.get("state", "")
    owner = request.GET.get("owner", "")
    if state in JobState.values:
        jobs = jobs.filter(state=state)
    if owner:
        jobs = jobs.filter(owner__username=owner)
    return render(
        request,
        "jobs/list.html",
        {"jobs": jobs[:500], "states": JobState.values, "state": state, "owner": owner},
    )


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    try:
        job = job_for(request.user, job_id)
    except ApiError as exc:
        if exc.status == 404:
            raise Http404(exc.message) from exc
        raise PermissionDenied(exc.message) from exc
    return render(
        request,
        "jobs/detail.html",
        {
            "job": job,
            "allocations": job.allocations.select_related("device__node"),
            "resizes": job.resizes.all(),
            "logs": job.logs.order_by("-id")[:50][::-1],
        },
    )
