"""Pages: the cluster board, the job list, the submit form and the job page. They read and call
the same services as the API; everything live arrives over the one socket (/ws/live/)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from elastic.workloads import CATALOGUE
from portal.errors import ApiError
from portal.jobs.access import job_for
from portal.jobs.api import detail, listed, summary
from portal.jobs.forms import errors_by_input, hyperparameter_fields, spec_from_post, uses_yaml
from portal.jobs.models import Job
from portal.jobs.services import submit_job
from portal.jobs.states import ACTIVE_STATES, JobState


def _viewer(request: HttpRequest) -> dict[str, Any]:
    return {"username": request.user.get_username(), "is_staff": request.user.is_staff}


@login_required
def board(request: HttpRequest) -> HttpResponse:
    jobs = listed(Job.objects.filter(state__in=ACTIVE_STATES)).order_by("created_at")
    return render(
        request,
        "board.html",
        {"bootstrap": {"viewer": _viewer(request), "jobs": [summary(j) for j in jobs]}},
    )


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    jobs = listed(Job.objects.all()).order_by("-created_at")
    state = request.GET.get("state", "")
    owner = request.GET.get("owner", "")
    if state in JobState.values:
        jobs = jobs.filter(state=state)
    if owner:
        jobs = jobs.filter(owner__username=owner)
    rows = [summary(j) for j in jobs[:500]]
    return render(
        request,
        "jobs/list.html",
        {
            "jobs": rows,
            "states": JobState.values,
            "state": state,
            "owner": owner,
            "bootstrap": {"viewer": _viewer(request), "filter": {"state": state, "owner": owner}},
        },
    )


@login_required
def submit_page(request: HttpRequest) -> HttpResponse:
    values: dict[str, Any] = {"workload": "digits-mlp", "min_workers": "1", "max_workers": "2",
                              "priority": "guaranteed", "consistency": "strict", "length_kind": "steps",
                              "length": "2000", "seed": "0"}
    errors: dict[str, str] = {}
    message = ""
    if request.method == "POST":
        values = {key: request.POST.get(key, "") for key in request.POST}
        try:
            spec = spec_from_post(request.POST, request.FILES, request.user)  # type: ignore[arg-type]
            if isinstance(spec, dict) and spec.get("code"):
                values["code_digest"] = spec["code"]  # kept for the next try, if this one fails
            job = submit_job(request.user, spec)
        except ApiError as exc:
            from_yaml = uses_yaml(request.POST, request.FILES)
            errors = errors_by_input(exc, request.POST.get("workload", ""), from_yaml)
            if from_yaml:
                errors.setdefault("spec_yaml", "the YAML spec has errors: see the list below")
            message = exc.message
        else:
            return redirect("job-page", job_id=job.pk)
    workloads = []
    for info in CATALOGUE.values():
        fields = []
        for field in hyperparameter_fields(info.name):
            input_id = field.input_id(info.name)
            fields.append({"field": field, "id": input_id,
                           "value": values.get(input_id, field.default), "error": errors.get(input_id)})
        workloads.append({"info": info, "fields": fields})
    return render(
        request,
        "jobs/submit.html",
        {"values": values, "errors": errors, "message": message, "workloads": workloads},
        status=400 if errors or message else 200,
    )


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    try:
        job = job_for(request.user, job_id)
    except ApiError as exc:
        if exc.status == 404:
            raise Http404(exc.message) from exc
        raise PermissionDenied(exc.message) from exc
    metrics = list(job.metrics.order_by("-at").values("step", "loss", "samples_per_s", "metrics", "at")[:2000])[::-1]
    evaluations = list(job.evaluations.order_by("step", "at").values("step", "metrics")[:2000])
    logs = list(job.logs.order_by("-id").values("id", "generation", "rank", "line")[:200])[::-1]
    return render(
        request,
        "jobs/detail.html",
        {
            "job": job,
            "bootstrap": {
                "viewer": _viewer(request),
                "job": detail(job),
                "metrics": [{**m, "at": m["at"].timestamp()} for m in metrics],
                "evaluations": evaluations,
                "logs": logs,
            },
        },
    )
