"""Pages: the cluster board, the job list, the submit form and the job page. They read and call
the same services as the API; everything live arrives over the one socket (/ws/live/)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from elastic.workloads import CATALOGUE
from portal.auth import SignedInRequest
from portal.errors import ApiError
from portal.jobs import curves
from portal.jobs.access import job_for
from portal.jobs.api import detail, list_row
from portal.jobs.board import cluster_state
from portal.jobs.forms import (
    ERROR_SLOTS,
    OWN_CODE,
    chosen_workload,
    errors_by_input,
    hyperparameter_fields,
    spec_from_post,
    uses_yaml,
)
from portal.jobs.models import Job, listed
from portal.jobs.services import submit_job
from portal.jobs.states import FINAL_STATES, JobState

CHART_FIELDS = ("generation", "segment", "step", "loss", "samples_per_s", "metrics")


def _viewer(request: HttpRequest) -> dict[str, Any]:
    return {"username": request.user.get_username(), "is_staff": request.user.is_staff}


@login_required
def board(request: HttpRequest) -> HttpResponse:
    # The cluster as the socket's snapshot has it (devices and active jobs): the first draw knows
    # the devices (each bar's track is sized to them) and the history has rows to go to; the
    # snapshot then changes only what changed since the render.
    return render(request, "board.html", {"bootstrap": {"viewer": _viewer(request), "cluster": cluster_state()}})


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    """Everyone's jobs, filtered by state and owner. A filter that names no state or no user is
    refused (400, as the API does) with the reason next to its field, not taken for "no jobs"."""
    jobs = listed(Job.objects.all()).order_by("-created_at")
    state = request.GET.get("state", "")
    # PostgreSQL refuses a NUL in a query; no user's name has one.
    owner = request.GET.get("owner", "").replace("\x00", "\N{SYMBOL FOR NULL}")
    errors: dict[str, str] = {}
    if state and state not in JobState.values:
        errors["state"] = f"there is no state “{state}”; choose one of the list"
    elif state:
        jobs = jobs.filter(state=state)
    if owner and not get_user_model().objects.filter(username=owner).exists():
        errors["owner"] = f"there is no user named “{owner}”"
    elif owner:
        jobs = jobs.filter(owner__username=owner)
    rows = [] if errors else [list_row(j, request.user) for j in jobs[:500]]
    return render(
        request,
        "jobs/list.html",
        {
            "jobs": rows,
            "states": JobState.values,
            "state": state,
            "owner": owner,
            "errors": errors,
            "bootstrap": {"viewer": _viewer(request), "filter": {"state": state, "owner": owner}},
        },
        status=400 if errors else 200,
    )


@login_required
def submit_page(request: SignedInRequest) -> HttpResponse:
    values: dict[str, Any] = {"source": "catalogue", "workload": "digits-mlp", "min_workers": "1", "max_workers": "2",
                              "priority": "guaranteed", "consistency": "strict", "length_kind": "steps",
                              "length": "2000", "seed": "0"}
    errors: dict[str, str] = {}
    message = ""
    if request.method == "POST":
        values = {key: request.POST.get(key, "") for key in request.POST}
        workload = chosen_workload(request.POST)
        values["source"] = OWN_CODE if workload == OWN_CODE else "catalogue"
        try:
            spec = spec_from_post(request.POST, request.FILES, request.user)
            if isinstance(spec, dict) and spec.get("code"):
                values["code_digest"] = spec["code"]  # kept for the next try, if this one fails
            job = submit_job(request.user, spec)
        except ApiError as exc:
            from_yaml = uses_yaml(request.POST, request.FILES)
            errors = errors_by_input(exc, workload, from_yaml)
            if from_yaml:
                errors.setdefault("spec_yaml", "the YAML spec has errors: see the list below")
            message = exc.message
        else:
            return redirect("job-page", job_id=job.pk)
    workloads = []
    placed = set(ERROR_SLOTS)
    for info in CATALOGUE.values():
        fields = []
        for field in hyperparameter_fields(info.name):
            input_id = field.input_id(info.name)
            fields.append({"field": field, "id": input_id,
                           "value": values.get(input_id, field.default), "error": errors.get(input_id)})
            placed.add(input_id)
        placed.add(f"hp-{info.name}")
        workloads.append({"info": info, "fields": fields, "error": errors.get(f"hp-{info.name}")})
    # Every error the banner counts is shown: a YAML spec's all in one list, the form's beside
    # their inputs, and any with no input of its own under the banner.
    unplaced = {} if "spec_yaml" in errors else {name: text for name, text in errors.items() if name not in placed}
    return render(
        request,
        "jobs/submit.html",
        {"values": values, "errors": errors, "unplaced": unplaced, "message": message, "workloads": workloads},
        status=400 if errors or message else 200,
    )


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    try:
        job = job_for(request.user, job_id)
    except ApiError as exc:
        if exc.status == 404:
            raise Http404(f"there is no job {job_id}") from exc
        raise PermissionDenied(f"job {job_id} is not yours; only its owner and staff may see its page") from exc
    curve = curves.curve(job)
    evaluations = list(job.evaluations.order_by("step", "at").values("step", "metrics")[:2000])
    logs = list(job.logs.order_by("-id").values("id", "generation", "rank", "line")[:200])[::-1]
    return render(
        request,
        "jobs/detail.html",
        {
            "job": job,
            "ended": job.state in FINAL_STATES,
            "bootstrap": {
                "viewer": _viewer(request),
                "job": detail(job),
                "metrics": [
                    {**{k: m[k] for k in CHART_FIELDS}, "at": m["at"].timestamp()} for m in curve.points
                ],
                "rollbacks": [{**asdict(r), "at": r.at.timestamp()} for r in curve.rollbacks],
                "evaluations": evaluations,
                "logs": logs,
            },
        },
    )
