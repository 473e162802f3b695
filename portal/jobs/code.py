"""A job's own code in the portal: uploads checked and repacked by elastic.codepack, stored once
per sha256 under settings.BUNGEE.code_dir, and who may use each digest (whoever uploaded it, and
staff). The API (portal.jobs.code_api), the submit form and the agents' fetch go through here."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.contrib.auth.models import AnonymousUser, User

from elastic.codepack import (
    LEAVE_OUT_ADVICE,
    ArchiveError,
    EntrypointError,
    Limit,
    Packed,
    check_entrypoint,
    read_top_files,
    repack,
)
from elastic.requirements import (
    MAX_FILE_BYTES,
    PYPROJECT_FILE,
    REQUIREMENTS_FILE,
    RequirementsError,
    conflicts,
    declared_in,
)
from elastic.spec import FieldError
from portal.errors import ApiError
from portal.jobs.models import CodeUpload

LIMIT_SETTINGS = {Limit.FILES: "BUNGEE_CODE_MAX_FILES", Limit.UNPACKED_BYTES: "BUNGEE_CODE_MAX_UNPACKED_BYTES"}
"""The setting that sets each limit of elastic.codepack, named in a refusal."""


def code_dir() -> Path:
    return settings.BUNGEE.code_dir


def archive_path(digest: str) -> Path:
    """Where the canonical tar.gz of `digest` is kept."""
    return code_dir() / f"{digest}.tar.gz"


def code_limits() -> dict[str, int]:
    """The limits an upload of code must keep, as the API tells clients (CodeLimitsOut)."""
    limits = settings.BUNGEE
    return {"max_bytes": limits.code_max_bytes, "max_unpacked_bytes": limits.code_max_unpacked_bytes,
            "max_files": limits.code_max_files}


def too_big(size: int) -> ApiError:
    limit = settings.BUNGEE.code_max_bytes
    return ApiError(
        413, "too_large",
        f"the code upload is {size} bytes; code may be at most {limit} bytes (BUNGEE_CODE_MAX_BYTES); {LEAVE_OUT_ADVICE}",
        [FieldError("file", f"at most {limit} bytes", size)],
    )


def store(owner: User, upload: BinaryIO, size: int, name: str) -> tuple[CodeUpload, Packed]:
    """Checks the archive `upload` (`size` bytes, called `name`), keeps its canonical form, and
    records that `owner` uploaded it. Raises ApiError 413 when a limit is passed, 400 when the
    archive is not acceptable (the member named)."""
    limits = settings.BUNGEE
    if size > limits.code_max_bytes:
        raise too_big(size)
    directory = code_dir()
    directory.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=directory, suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as out:
            try:
                packed = repack(upload, out, limits.code_max_unpacked_bytes, limits.code_max_files)
            except ArchiveError as err:
                raise _refusal(err, name) from err
        check_requirements(Path(temporary), name)
        os.replace(temporary, archive_path(packed.digest))
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    row, _ = CodeUpload.objects.update_or_create(
        owner=owner, digest=packed.digest, defaults={"size": packed.size, "files": packed.files}
    )
    return row, packed


def check_requirements(archive: Path, name: str) -> None:
    """Refuses code whose requirements.txt (or pyproject.toml dependencies) is not one a node
    builds (elastic.requirements), or asks for a version of a package the runtime is built on
    that the nodes do not have: 400 `invalid_requirements`, naming the line, or the file that is
    over elastic.requirements.MAX_FILE_BYTES. The file checked is the one an agent builds from
    (elastic.requirements.declaring_file, inside declared_in). The nodes' packages are taken to be
    this portal's: the portal and the agents run one image."""
    try:
        declared = declared_in(
            read_top_files(archive, (REQUIREMENTS_FILE, PYPROJECT_FILE), MAX_FILE_BYTES),
            settings.BUNGEE.env_index_options,
        )
        refused = conflicts(declared, installed_distributions()) if declared is not None else []
    except RequirementsError as err:
        refused = [err]
    if refused:
        raise ApiError(
            400, "invalid_requirements", f"{name}: {refused[0]}",
            [FieldError("file", str(err), err.text) for err in refused],
        )


@functools.cache
def installed_distributions() -> dict[str, str]:
    """name -> version of every distribution installed where the portal runs."""
    return {dist.metadata["Name"]: dist.version for dist in importlib.metadata.distributions() if dist.metadata["Name"]}


def _refusal(err: ArchiveError, name: str) -> ApiError:
    """413 naming the limit passed and its setting, or 400 naming what is wrong with the archive."""
    if err.limit is None:
        return ApiError(400, "invalid_archive", f"{name}: {err}", [FieldError("file", str(err), name)])
    reason = f"{err} ({LIMIT_SETTINGS[err.limit]})"
    return ApiError(413, "too_large", f"{name}: {reason}; {LEAVE_OUT_ADVICE}", [FieldError("file", reason, name)])


def upload_for(user: User | AnonymousUser, digest: str) -> CodeUpload | None:
    """The upload of `digest` that `user` may use: their own, or for staff anyone's."""
    if not user.is_authenticated:
        return None
    rows = CodeUpload.objects.filter(digest=digest)
    if not user.is_staff:
        rows = rows.filter(owner_id=user.pk)
    row: CodeUpload | None = rows.order_by("-uploaded_at").first()
    if row is None or not archive_path(digest).exists():
        return None
    return row


def check_usable(user: User, digest: str, entrypoint: str) -> None:
    """Raises ApiError 400 on the spec's `code` if `user` may not run `digest`, and on its
    `entrypoint` if the code's module does not define that class (read statically: nothing of
    the user's code is imported or run here)."""
    if upload_for(user, digest) is None:
        raise ApiError(
            400, "invalid_spec", "the job spec has 1 invalid field",
            [FieldError("code", "no code with this digest was uploaded by you; upload it with POST /api/code", digest)],
        )
    try:
        with archive_path(digest).open("rb") as archive:
            check_entrypoint(archive, entrypoint)
    except (EntrypointError, ArchiveError) as err:
        raise ApiError(400, "invalid_spec", f"the job spec has 1 invalid field: {err}",
                       [FieldError("entrypoint", str(err), entrypoint)]) from err
