"""A job's model, checkpoint and manifest in the portal (elastic.worker.artifacts): taken from the
agent of the node whose rank 0 wrote them, checked against the manifest's digests, kept under
settings.BUNGEE.artifact_dir/job-N after the job's nodes are gone, handed to the job's owner and staff,
and deleted BUNGEE_ARTIFACT_RETENTION_DAYS days after the job ended."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.utils import timezone

from elastic.artifacts import ARTIFACT_NAMES, MANIFEST_NAME, MODEL_NAME
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


def store(node: Node, job: Job, uploads: dict[str, UploadedFile]) -> JobArtifacts:
    """Keeps the artifacts `node`'s agent sent for `job`. Raises ApiError 403 if the job's rank 0
    (the worker that writes them) never ran on that node, 400 if a file is missing, the manifest
    is not the job's or a file is not what the manifest's digest says."""
    if not Worker.objects.filter(job=job, node=node, rank=0).exists():
        raise forbidden(f"rank 0 of job {job.pk} never ran on node {node.name!r}; its artifacts come from there")
    for name in ARTIFACT_NAMES:
        if name not in uploads:
            raise _refused(f"{name} is missing ({CUT_SHORT})", name)
    try:
        manifest = json.loads(uploads[MANIFEST_NAME].read(1 << 20))
    except ValueError as err:
        raise _refused(f"{MANIFEST_NAME} is not JSON: {err}", MANIFEST_NAME) from err
    if not isinstance(manifest, dict) or manifest.get("job_id") != job.pk or not isinstance(manifest.get("files"), dict):
        raise _refused(f"{MANIFEST_NAME} is not job {job.pk}'s", MANIFEST_NAME)
    target = job_dir(job.pk)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    try:
        for name in ARTIFACT_NAMES:
            got = _write_hashed(uploads[name], staging / name)
            wanted = manifest["files"].get(name, got) if name != MANIFEST_NAME else got
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
            "step": int(manifest.get("step") or 0),
            "ended": str(manifest.get("ended") or ""),
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
    return {
        "step": row.step,
        "ended": row.ended,
        "stored_at": row.stored_at,
        "files": [
            {"name": name, **info, "url": f"/api/jobs/{job.pk}/artifacts/{name}"} for name, info in row.files.items()
        ],
        "final": row.manifest.get("final"),
        "bungee_version": row.manifest.get("bungee_version"),
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
