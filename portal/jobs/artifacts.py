"""A job's model, checkpoint and manifest in the portal (elastic.worker.artifacts): taken from the
agent of the node whose rank 0 wrote them, checked against the manifest's digests, kept under
settings.BUNGEE.artifact_dir/job-N after the job's nodes are gone, handed to the job's owner and staff,
and deleted BUNGEE_ARTIFACT_RETENTION_DAYS days after the job ended."""

from __future__ import annotations

import hashlib
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.utils import timezone
from pydantic import ValidationError

from elastic.artifacts import ARTIFACT_NAMES, MANIFEST_MAX_BYTES, MANIFEST_NAME, MODEL_NAME, Manifest
from elastic.spec import FieldError
from portal.cluster.models import Node
from portal.errors import ApiError, forbidden
from portal.jobs import lifecycle
from portal.jobs.models import Job, JobArtifacts, Worker
from portal.live import broadcast
from portal.uploads import CUT_SHORT

log = logging.getLogger(__name__)


def job_dir(job_id: int) -> Path:
    return settings.BUNGEE.artifact_dir / f"job-{job_id}"


def _refused(message: str, name: str) -> ApiError:
    return ApiError(400, "invalid_artifacts", message, [FieldError(name, message, None)])


def _write_hashed(upload: UploadedFile, path: Path) -> str:
    """Writes `upload` to `path` in one pass, returning its sha256."""
    digest = hashlib.sha256()
    upload.seek(0)
    with path.open("wb") as out:
        for chunk in upload.chunks():
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _checked_manifest(upload: UploadedFile) -> Manifest:
    """The manifest in `upload`, checked against its schema. Raises ApiError 400 naming the first
    field that is wrong (as `manifest.json.<field>`), or the file if it is not JSON or too big."""
    upload.seek(0)
    text = upload.read(MANIFEST_MAX_BYTES + 1)
    if len(text) > MANIFEST_MAX_BYTES:
        raise _refused(f"{MANIFEST_NAME} is over {MANIFEST_MAX_BYTES} bytes", MANIFEST_NAME)
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as err:
        problems = err.errors(include_url=False)
        fields = [
            FieldError(".".join([MANIFEST_NAME, *(str(part) for part in problem["loc"])]), problem["msg"],
                       problem.get("input") if problem["type"] != "json_invalid" else None)
            for problem in problems
        ]
        message = "; ".join(f"{field.field}: {field.message}" for field in fields)
        raise ApiError(400, "invalid_artifacts", f"{MANIFEST_NAME} is not a valid manifest: {message}", fields) from err


def readable_manifest(stored: Any) -> dict[str, Any] | None:
    """A manifest as stored, if it still passes its schema; None for one kept before manifests
    were checked that does not (the API then shows it as absent rather than fail)."""
    try:
        return Manifest.model_validate(stored).stored()
    except ValidationError:
        return None


def store(node: Node, job: Job, uploads: dict[str, UploadedFile]) -> JobArtifacts:
    """Keeps the artifacts `node`'s agent sent for `job`. Raises ApiError 403 if the job's rank 0
    (the worker that writes them) never ran on that node, 400 if a file is missing, the manifest
    fails its schema (elastic.artifacts.Manifest) or is not the job's, or a file is not what the
    manifest's digest says."""
    if not Worker.objects.filter(job=job, node=node, rank=0).exists():
        raise forbidden(f"rank 0 of job {job.pk} never ran on node {node.name!r}; its artifacts come from there")
    for name in ARTIFACT_NAMES:
        if name not in uploads:
            raise _refused(f"{name} is missing ({CUT_SHORT})", name)
    checked = _checked_manifest(uploads[MANIFEST_NAME])
    if checked.job_id != job.pk:
        raise _refused(f"{MANIFEST_NAME} is not job {job.pk}'s but job {checked.job_id}'s", f"{MANIFEST_NAME}.job_id")
    manifest = checked.stored()
    target = job_dir(job.pk)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    try:
        for name in ARTIFACT_NAMES:
            got = _write_hashed(uploads[name], staging / name)
            wanted = manifest["files"][name] if name != MANIFEST_NAME else got
            if got != wanted:
                raise _refused(f"{name} has sha256 {got}, the manifest says {wanted}", name)
            files[name] = {"size": uploads[name].size, "sha256": got}
    except ApiError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    row, _ = JobArtifacts.objects.update_or_create(
        job=job,
        defaults={
            "step": checked.step,
            "ended": checked.ended,
            "manifest": manifest,
            "files": files,
            "node": node.name,
            "stored_at": timezone.now(),
        },
    )
    lifecycle.state_kept(job, row.step)
    broadcast.job_changed(job)
    return row


def described(job: Job) -> dict[str, Any] | None:
    """What the API says of the job's artifacts, or None if there are none."""
    row = JobArtifacts.objects.filter(job=job).first()
    if row is None:
        return None
    manifest = readable_manifest(row.manifest)
    return {
        "step": row.step,
        "ended": row.ended,
        "stored_at": row.stored_at,
        "files": [
            {"name": name, **info, "url": f"/api/jobs/{job.pk}/artifacts/{name}"} for name, info in row.files.items()
        ],
        "final": manifest.get("final") if manifest is not None else None,
        "bungee_version": manifest.get("bungee_version") if manifest is not None else None,
        "manifest_valid": manifest is not None,
    }


def file_path(job: Job, name: str) -> Path | None:
    """The stored file `name` of the job's artifacts, or None."""
    if name not in ARTIFACT_NAMES or not JobArtifacts.objects.filter(job=job).exists():
        return None
    path = job_dir(job.pk) / name
    return path if path.exists() else None


def check_init_from(user: User, job_id: int) -> None:
    """Raises ApiError 400 on the spec's `init_from` unless job `job_id` is `user`'s (or `user`
    is staff) and its final model is kept. Another user's job reads as absent."""
    source = Job.objects.filter(pk=job_id).first()
    if source is not None and not (user.is_staff or source.owner_id == user.pk):  # type: ignore[attr-defined]
        source = None
    if source is None or file_path(source, MODEL_NAME) is None:
        message = f"no job {job_id} of yours has a final model to start from"
        raise ApiError(400, "invalid_spec", message, [FieldError("init_from", message, job_id)])


def initial_model(job: Job) -> tuple[Path, str] | None:
    """The model file `job` starts from (its spec's init_from) and its sha256, or None."""
    source_id = job.spec.get("init_from")
    if not source_id:
        return None
    row = JobArtifacts.objects.filter(job_id=source_id).first()
    path = job_dir(int(source_id)) / MODEL_NAME
    if row is None or not path.exists():
        return None
    return path, str(row.files[MODEL_NAME]["sha256"])


def prune() -> list[int]:
    """Deletes the artifacts of jobs that ended more than ARTIFACT_RETENTION_DAYS ago (none if
    it is 0). Returns those jobs' ids."""
    days = settings.BUNGEE.artifact_retention_days
    if days <= 0:
        return []
    cutoff = timezone.now() - timedelta(days=days)
    old = list(JobArtifacts.objects.filter(job__finished_at__lt=cutoff).values_list("job_id", flat=True))
    for job_id in old:
        shutil.rmtree(job_dir(job_id), ignore_errors=True)
    JobArtifacts.objects.filter(job_id__in=old).delete()
    if old:
        log.info("deleted the artifacts of jobs %s (older than %d days)", old, days)
    return old
