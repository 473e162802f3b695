"""The agent's copies of jobs' own code. Each archive is fetched from the portal once per digest
(with the agent token), checked against that digest, and kept; each job gets its own unpacked
copy, so that no job's files (its __pycache__ included) are another's. What the agent unpacks
passes the same checks as what the portal took in (elastic.codepack). A job's copies go once no
worker of it has run on the node for a while (`sweep`, from the agent's report loop)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from elastic.codepack import ArchiveError, file_digest, unpack

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
"""The agent's own bound on a fetched archive (the portal's limits are lower)."""
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_MODEL_BYTES = 64 * 1024 * 1024 * 1024
"""The agent's bound on a model a job starts from (init_from)."""
INITIAL_MODEL_NAME = "initial-model.pt"


class CodeUnavailable(Exception):  # noqa: N818 - a condition, reported as a failed start
    """The job's code could not be had, or was not what its digest says."""


class CodeSource(Protocol):
    def fetch_code(self, digest: str, out: BinaryIO, max_bytes: int) -> None: ...

    def fetch_initial_model(self, job_id: int, out: BinaryIO, max_bytes: int) -> str: ...


class CodeCache:
    """Archives under `state_dir/code`, unpacked copies under `state_dir/jobs/job-N/code`, and
    the model a job starts from (init_from) at `state_dir/jobs/job-N/initial-model.pt`."""

    def __init__(self, source: CodeSource, state_dir: Path) -> None:
        self._source = source
        self._archives = state_dir / "code"
        self._jobs = state_dir / "jobs"
        self._lock = threading.Lock()

    def prepare(self, job_id: int, digest: str) -> Path:
        """The directory of job `job_id`'s code `digest`, fetched and unpacked if need be.
        Raises CodeUnavailable."""
        with self._lock:
            archive = self._archive(digest)
            target = self._jobs / f"job-{job_id}" / "code"
            marker = target.parent / "code.digest"
            if target.is_dir() and marker.exists() and marker.read_text() == digest:
                os.utime(target.parent)
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            try:
                unpack(archive, target, MAX_UNPACKED_BYTES)
            except ArchiveError as err:
                raise CodeUnavailable(f"code {digest} cannot be unpacked: {err}") from err
            marker.write_text(digest)
            return target

    def initial_model(self, job_id: int) -> Path:
        """The model job `job_id` starts from, fetched once and checked against the sha256 the
        portal holds for it. Raises CodeUnavailable."""
        with self._lock:
            target = self._jobs / f"job-{job_id}" / INITIAL_MODEL_NAME
            if target.exists():
                os.utime(target.parent)
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            _fetch_checked(
                target,
                lambda out: self._source.fetch_initial_model(job_id, out, MAX_MODEL_BYTES),
                f"the model job {job_id} starts from",
            )
            return target

    def sweep(self, live_jobs: set[int], kept_s: float) -> list[int]:
        """Deletes the directories of jobs not in `live_jobs` untouched for `kept_s` (a job's
        directory is touched whenever it is prepared); returns their ids."""
        deleted = []
        cutoff = time.time() - kept_s
        with self._lock:
            for directory in self._jobs.glob("job-*"):
                try:
                    job_id = int(directory.name.removeprefix("job-"))
                    idle = directory.stat().st_mtime < cutoff
                except (ValueError, OSError):
                    continue
                if job_id not in live_jobs and idle:
                    shutil.rmtree(directory, ignore_errors=True)
                    deleted.append(job_id)
        return sorted(deleted)

    def _archive(self, digest: str) -> Path:
        archive = self._archives / f"{digest}.tar.gz"
        if archive.exists():
            return archive
        self._archives.mkdir(parents=True, exist_ok=True)

        def fetch(out: BinaryIO) -> str:
            self._source.fetch_code(digest, out, MAX_ARCHIVE_BYTES)
            return digest

        _fetch_checked(archive, fetch, f"code {digest}")
        log.info("fetched code %s", digest)
        return archive


def _fetch_checked(target: Path, fetch: Callable[[BinaryIO], str], what: str) -> None:
    """Writes what `fetch` writes to `target`, if its sha256 is the one `fetch` returns, through
    a temporary file beside it. Raises CodeUnavailable."""
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as out:
            try:
                expected = fetch(out)
            except Exception as err:  # PortalError, or the disk
                raise CodeUnavailable(f"cannot fetch {what}: {err}") from err
        got = file_digest(Path(temporary))
        if got != expected:
            raise CodeUnavailable(f"refused {what}: what the portal sent has sha256 {got}, not {expected!r}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
