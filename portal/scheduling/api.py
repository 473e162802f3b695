"""The scheduler's latest decision, for staff (the staff page reads the same)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router

from portal.auth import require_staff, user_auth
from portal.errors import not_found
from portal.scheduling.models import SchedulerDecision

router = Router(auth=user_auth, tags=["scheduler"])


def decision_view(decision: SchedulerDecision) -> dict[str, Any]:
    return {
        "decided_at": decision.decided_at,
        "policy": decision.policy,
        "resize_cost_s": decision.resize_cost_s,
        "decision_ms": decision.decision_ms,
        "devices_total": decision.devices_total,
        "devices_available": decision.devices_available,
        "jobs": decision.jobs,
        "lent_devices": decision.lent_devices,
        "stragglers": decision.stragglers,
        "changed_jobs": decision.changed_jobs,
    }


@router.get("/decisions/latest", summary="The scheduler's latest decision (staff)")
def latest_decision(request: HttpRequest) -> dict[str, Any]:
    require_staff(request.user, "see the scheduler's decisions")
    decision = SchedulerDecision.objects.first()
    if decision is None:
        raise not_found("a scheduling decision")
    return decision_view(decision)
