"""Code endpoints: upload a job's own code, list yours, download an upload (its uploader and
staff); and the agents' fetch of the code of a job their node runs."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.http import FileResponse, HttpRequest
from ninja import Router, Status

from elastic.spec import CODE_DIGEST_PATTERN, FieldError
from portal.auth import agent_auth, user_auth
from portal.cluster.models import Node
from portal.errors import ApiError, forbidden, not_found
from portal.jobs.code import archive_path, store, too_big, upload_for
from portal.jobs.models import CodeUpload, Job
from portal.jobs.states import ACTIVE_STATES
from portal.uploads import CUT_SHORT, multipart_files

router = Router(auth=user_auth, tags=["code"])
agent_code_router = Router(auth=agent_auth, tags=["agents"])

UPLOAD_OVERHEAD_BYTES = 1 << 20
"""What a multipart body may hold beyond the file itself (headers, boundaries, other fields)."""


def _described(row: CodeUpload) -> dict[str, Any]:
    return {"digest": row.digest, "size": row.size, "files": row.files, "uploaded_at": row.uploaded_at}


def _check_digest(digest: str) -> None:
    if not re.fullmatch(CODE_DIGEST_PATTERN, digest):
        raise ApiError(400, "invalid_request", f"{digest!r} is not a sha256 digest (64 hex digits)",
                       [FieldError("digest", "64 lowercase hex digits", digest)])


@router.post(
    "",
    response={201: dict},
    summary="Upload a job's code: a tar.gz or zip as the multipart field 'file'",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}},
                        "required": ["file"],
                    }
                }
            },
        }
    },
)
def upload(request: HttpRequest) -> Status:
    declared = request.META.get("CONTENT_LENGTH")
    if (
        declared
        and declared.isdigit()
        and int(declared) > settings.BUNGEE.code_max_bytes + UPLOAD_OVERHEAD_BYTES
    ):
        raise too_big(int(declared))
    archive = multipart_files(request, "the archive in a field named 'file'").get("file")
    if archive is None:
        raise ApiError(400, "invalid_request", f"no field named 'file' in the upload ({CUT_SHORT})",
                       [FieldError("file", "required", None)])
    row, packed = store(request.user, archive, archive.size or 0, archive.name or "upload")  # type: ignore[arg-type]
    return Status(201, {**_described(row), "unpacked_bytes": packed.unpacked_bytes})


@router.get("", response=list[dict], summary="Your uploads, newest first")
def list_uploads(request: HttpRequest) -> list[dict[str, Any]]:
    rows = CodeUpload.objects.filter(owner_id=request.user.pk).order_by("-uploaded_at")[:200]
    return [_described(row) for row in rows]


@router.get("/{digest}", summary="Download an upload (its uploader and staff)")
def download(request: HttpRequest, digest: str) -> FileResponse:
    _check_digest(digest)
    if upload_for(request.user, digest) is None:
        raise not_found(f"code {digest} of yours")
    return FileResponse(archive_path(digest).open("rb"), as_attachment=True, filename=f"code-{digest[:12]}.tar.gz")


@agent_code_router.get("/code/{digest}", summary="An agent fetches the code of a job its node runs")
def agent_fetch(request: HttpRequest, digest: str) -> FileResponse:
    """403 unless an active job with this code holds a device of the token's node."""
    _check_digest(digest)
    node = Node.objects.filter(agent_token=request.api_token).first()  # type: ignore[attr-defined]
    if node is None:
        raise forbidden("this agent token has registered no node yet")
    runs_here = Job.objects.filter(code=digest, state__in=ACTIVE_STATES, allocations__device__node=node).exists()
    if not runs_here or not archive_path(digest).exists():
        raise forbidden(f"no job on node {node.name!r} runs code {digest}")
    return FileResponse(archive_path(digest).open("rb"), content_type="application/gzip")
