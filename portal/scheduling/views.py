"""The staff page of the scheduler: its latest decision in full, and the recent ones."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from portal.auth import require_staff
from portal.errors import ApiError
from portal.scheduling.api import decision_view
from portal.scheduling.models import SchedulerDecision
from portal.scheduling.policy import policy_name
from portal.slurm.status import pool_view

RECENT = 20


@login_required
def scheduler_page(request: HttpRequest) -> HttpResponse:
    try:
        require_staff(request.user, "see the scheduler's decisions")
    except ApiError as exc:
        raise PermissionDenied(exc.message) from exc
    recent = list(SchedulerDecision.objects.all()[:RECENT])
    return render(
        request,
        "scheduler.html",
        {
            "policy": policy_name(),
            "latest": decision_view(recent[0]) if recent else None,
            "recent": recent,
            "slurm_pool": pool_view(),
        },
    )
