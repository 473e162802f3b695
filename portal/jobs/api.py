"""Job endpoints: submit, list, detail, resize, cancel, metrics, logs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser, User
from django.http import FileResponse, HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema, Status

from elastic.spec import FieldError, JobSpec
from portal.auth import SignedInRequest, user_auth
from portal.bodies import BodyError, parse_json, parse_yaml
from portal.errors import ApiError, not_found
from portal.jobs import artifacts, curves
from portal.jobs.access import job_for, may_manage
from portal.jobs.code import code_limits
from portal.jobs.models import Job, listed
from portal.jobs.schemas import (
    EvaluationOut,
    JobDetailOut,
    JobSummaryOut,
    LogOut,
    MetricsOut,
    ResizeIn,
    SpecCheckOut,
)
from portal.jobs.services import cancel_job, dry_run, request_resize, submit_job
from portal.jobs.states import FINAL_STATES, JobState

router = Router(auth=user_auth, tags=["jobs"])

MAX_EVALUATIONS = 5000
MAX_LOG_LINES = 1000
LIST_PAGE = 100
LIST_PAGE_MAX = 500


CurvePoints = Annotated[
    int, Field(ge=2, le=curves.MAX_POINTS, description="at most this many points, covering the whole run")
]


def summary(job: Job) -> dict[str, Any]:
    return job.summary()


def list_row(job: Job, viewer: User | AnonymousUser) -> dict[str, Any]:
    """A job as a list shows it to `viewer`: its summary, and why it ended where the viewer may read
    its details (its owner, staff); '' for anyone else."""
    return {**summary(job), "reason": job.ended_reason() if may_manage(viewer, job) else ""}


def detail(job: Job) -> dict[str, Any]:
    return {
        **summary(job),
        "reason": job.ended_reason(),
        "spec": job.spec,
        "message": job.message,
        "restarts": job.restarts,
        "attained_service_s": job.attained_service_s,
        "last_loss": job.last_loss,
        "samples_per_s": job.samples_per_s,
        "virtual_workers": job.spec.get("virtual_workers") if job.consistency == "strict" else None,
        "global_batch": job.global_batch,
        "learning_rate": job.learning_rate,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "allocations": [
            {"rank": a.rank, "device_id": a.device_id, "node": a.device.node.name, "device_index": a.device.index,
             "backend": a.device.node.backend}
            for a in job.allocations.select_related("device__node")
        ],
        "resizes": [
            {**row, "land_s": (row["completed_at"] - row["requested_at"]).total_seconds() if row["completed_at"] else None}
            for row in job.resizes.values(
                "generation", "reason", "workers_before", "workers_after", "devices_before",
                "devices_after", "requested_at", "requested_by", "completed_at", "pause_s", "step",
                "members_before", "members_after", "bytes_moved", "phases",
            )
        ],
        "artifacts": artifacts.described(job),
        "workers_history": [
            {"generation": w.generation, "rank": w.rank, "node": w.node_name, "device_index": w.device_index,
             "pid": w.pid, "state": w.state, "exit_code": w.exit_code, "reason": w.reason}
            for w in job.workers.all()
        ],
        "own_packages": own_packages(job),
    }


def own_packages(job: Job) -> dict[str, Any] | None:
    """The job's own packages as its node reported them, the packages sorted by name (the
    database keeps no order)."""
    if not job.own_packages:
        return None
    return {**job.own_packages, "packages": dict(sorted(job.own_packages.get("packages", {}).items()))}


JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


def _parse_body(request: HttpRequest) -> Any:
    """The spec in the body, as JSON or YAML by its Content-Type (portal.bodies bounds both).
    Raises ApiError 415 for another type, 400 for a body that does not parse."""
    content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type not in JSON_TYPES + YAML_TYPES:
        raise ApiError(
            415, "unsupported_media_type",
            f"send the spec as application/json or application/yaml, not {content_type or 'no Content-Type'}",
            [FieldError("Content-Type", "application/json or application/yaml", content_type)],
        )
    text = request.body.decode("utf-8", errors="replace")
    try:
        return parse_yaml(text) if content_type in YAML_TYPES else parse_json(text)
    except BodyError as err:
        raise ApiError(400, "malformed_body", str(err), [FieldError("body", str(err), None)]) from err


SPEC_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": JobSpec.model_json_schema()},
        "application/yaml": {"schema": JobSpec.model_json_schema()},
    },
}
"""A job spec in a request's body, as JSON or YAML."""


@router.post(
    "",
    response={201: JobDetailOut},
    summary="Submit a job",
    openapi_extra={"requestBody": SPEC_BODY},
)
def submit(request: SignedInRequest) -> Status:
    job = submit_job(request.user, _parse_body(request))
    return Status(201, detail(job))


@router.post(
    "/validate",
    response={200: SpecCheckOut},
    summary="Check a job spec as a submit would, storing nothing (a dry run: before uploading code)",
    openapi_extra={"requestBody": SPEC_BODY},
)
def validate(request: SignedInRequest) -> dict[str, Any]:
    spec, uploaded = dry_run(request.user, _parse_body(request))
    return {"spec": spec.model_dump(), "code_uploaded": uploaded, "code_limits": code_limits()}


class JobFilter(Schema):
    state: JobState | None = None
    owner: str | None = None
    limit: int = Field(LIST_PAGE, ge=1, le=LIST_PAGE_MAX, description="at most this many jobs")
    before: int | None = Field(None, ge=1, description="only jobs with a smaller id: the next page")


@router.get(
    "", response=list[JobSummaryOut],
    summary="List jobs (everyone's, as squeue does), newest first, a page at a time",
    description="A page of at most `limit` jobs. When there are more, the `Link` header holds the next "
    'page\'s address (`rel="next"`, as GitHub\'s API does); `X-Total-Count` counts every job the filters match.',
)
def list_jobs(request: HttpRequest, response: HttpResponse, filters: Query[JobFilter]) -> list[dict[str, Any]]:
    jobs = Job.objects.all()
    if filters.state:
        jobs = jobs.filter(state=filters.state)
    if filters.owner:
        if "\x00" in filters.owner:
            raise ApiError(400, "invalid_request", "owner contains a NUL character",
                           [FieldError("owner", "contains a NUL character", filters.owner)])
        if not get_user_model().objects.filter(username=filters.owner).exists():
            raise ApiError(400, "invalid_request", f"no user named {filters.owner!r}",
                           [FieldError("owner", "no such user", filters.owner)])
        jobs = jobs.filter(owner__username=filters.owner)
    response["X-Total-Count"] = str(jobs.count())
    if filters.before is not None:
        jobs = jobs.filter(pk__lt=filters.before)
    page = list(listed(jobs).order_by("-pk")[: filters.limit + 1])
    if len(page) > filters.limit:
        page = page[: filters.limit]
        following = request.GET.copy()  # the same filters, every value of each
        following["before"] = str(page[-1].pk)
        response["Link"] = f'<{request.build_absolute_uri(request.path)}?{following.urlencode()}>; rel="next"'
    return [list_row(job, request.user) for job in page]


@router.get("/{int:job_id}", response=JobDetailOut, summary="A job's details (owner and staff)")
def get_job(request: SignedInRequest, job_id: int) -> dict[str, Any]:
    return detail(job_for(request.user, job_id))


@router.post("/{int:job_id}/resize", response=JobDetailOut, summary="Pin a job to a worker count")
def resize(request: SignedInRequest, job_id: int, payload: ResizeIn) -> dict[str, Any]:
    job = request_resize(job_for(request.user, job_id), payload.workers, request.user)
    return detail(job)


@router.post(
    "/{int:job_id}/unpin", response=JobDetailOut, summary="Lift a job's pin: the scheduler decides its size again"
)
def unpin(request: SignedInRequest, job_id: int) -> dict[str, Any]:
    return detail(request_resize(job_for(request.user, job_id), None, request.user))


@router.post("/{int:job_id}/cancel", response=JobDetailOut, summary="Cancel a job")
def cancel(request: HttpRequest, job_id: int) -> dict[str, Any]:
    return detail(cancel_job(job_for(request.user, job_id)))


@router.get("/{int:job_id}/evaluations", response=list[EvaluationOut], summary="The task's evaluations, by step")
def evaluations(request: HttpRequest, job_id: int) -> Any:
    job = job_for(request.user, job_id)
    return list(job.evaluations.order_by("step", "at")[:MAX_EVALUATIONS])


@router.get(
    "/{int:job_id}/metrics", response=MetricsOut,
    summary="Loss, throughput and named metrics over the whole run, downsampled, with its rollbacks",
)
def metrics(request: HttpRequest, job_id: int, points: CurvePoints = curves.DEFAULT_POINTS) -> dict[str, Any]:
    job = job_for(request.user, job_id)
    curve = curves.curve(job, points)
    return {"points": curve.points, "rollbacks": [asdict(r) for r in curve.rollbacks], "rows": curve.rows}


@router.get("/{int:job_id}/logs", response=list[LogOut], summary="Log lines after `after` (an id)")
def logs(request: HttpRequest, job_id: int, after: int = 0) -> Any:
    job = job_for(request.user, job_id)
    return list(job.logs.filter(id__gt=after).order_by("id")[:MAX_LOG_LINES])


@router.get("/{int:job_id}/artifacts", summary="The job's model, checkpoint and manifest (owner and staff)")
def get_artifacts(request: HttpRequest, job_id: int) -> dict[str, Any]:
    """404 until the job has ended and its rank 0's agent has handed them over (the job may be
    reported ended before the upload is done)."""
    job = job_for(request.user, job_id)
    described = artifacts.described(job)
    if described is None and job.state in FINAL_STATES:
        raise not_found(
            f"the artifacts of job {job_id} (it {job.state}; its rank 0's agent uploads them after the last step, "
            "so they may be on their way; a job that trained no step, or whose files passed their retention, has none)"
        )
    if described is None:
        raise not_found(f"the artifacts of job {job_id} (it is {job.state}: a job has them once it has ended)")
    return {**described, "manifest": artifacts.readable_manifest(job.artifacts.manifest)}


@router.get("/{int:job_id}/artifacts/{name}", summary="Download model.pt, checkpoint.pt or manifest.json")
def download_artifact(request: HttpRequest, job_id: int, name: str) -> FileResponse:
    job = job_for(request.user, job_id)
    path = artifacts.file_path(job, name)
    if path is None:
        raise not_found(f"{name!r} of job {job_id}'s artifacts")
    return FileResponse(path.open("rb"), as_attachment=True, filename=f"job-{job_id}-{name}")

