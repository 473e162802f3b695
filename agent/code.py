"""The agent's copies of jobs' own code. Each archive is fetched from the portal once per digest
(with the agent token), checked against that digest, and kept; each job gets its own unpacked
copy, so that no job's files (its __pycache__ included) are another's. What the agent unpacks
passes the same checks as what the portal took in (elastic.codepack)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Protocol

from elastic.codepack import ArchiveError, file_digest, unpack

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
"""The agent's own bound on a fetched archive (the portal's limits are lower)."""
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024


class CodeUnavailable(Exception):  # noqa: N818 - a condition, reported as a failed start
    """The job's code could not be had, or was not what its digest says."""


class CodeSource(Protocol):
    def fetch_code(self, digest: str, out: BinaryIO, max_bytes: int) -> None: ...


class CodeCache:
    """Archives under `state_dir/code`, unpacked copies under `state_dir/jobs/job-N/code`."""

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
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            try:
                unpack(archive, target, MAX_UNPACKED_BYTES)
            except ArchiveError as err:
                raise CodeUnavailable(f"code {digest} cannot be unpacked: {err}") from err
            marker.write_text(digest)
            return target

    def _archive(self, digest: str) -> Path:
        archive = self._archives / f"{digest}.tar.gz"
        if archive.exists():
            return archive
        self._archives.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=self._archives, suffix=".partial")
        try:
            with os.fdopen(descriptor, "wb") as out:
                try:
                    self._source.fetch_code(digest, out, MAX_ARCHIVE_BYTES)
                except Exception as err:  # PortalError, or the disk
                    raise CodeUnavailable(f"cannot fetch code {digest}: {err}") from err
            got = file_digest(Path(temporary))
            if got != digest:
                raise CodeUnavailable(f"refused code {digest}: what the portal sent has sha256 {got}")
            os.replace(temporary, archive)
            log.info("fetched code %s", digest)
            return archive
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
