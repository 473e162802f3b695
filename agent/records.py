"""What the supervisor keeps on disk about each worker, so that an agent that died and started
again can take its workers back (re-adopt them) instead of losing them.

Per worker, in the agent's state directory under `workers/`, two files share a stem:
`<stem>.out`, the worker's stdout and stderr (the worker appends to it; it never writes to a pipe
that dies with the agent), and `<stem>.json`, a WorkerRecord, replaced whole (written aside, then
renamed) whenever it changes. A record outlives its worker until the worker's "exited" event has
reached the portal; then both files go.

A pid alone does not name a process for long: the kernel reuses pids. A record also keeps the
process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot), and a worker is
taken back only if a process with its pid started at that very time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from elastic.wire import UserError

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".json"
OUTPUT_SUFFIX = ".out"


class WorkerRecord(BaseModel):
    """One worker as its supervisor knows it."""

    model_config = ConfigDict(extra="ignore")

    job_id: int
    generation: int
    rank: int
    device_index: int
    pid: int
    start_time: int | None
    """The process's start time in clock ticks since boot; None where /proc could not tell."""
    output: str
    """The file the worker's stdout and stderr are appended to."""
    offset: int = 0
    """Bytes of `output` whose events reached the portal: a new supervisor reads on from here."""
    launched_generation: int = 0
    stop_before_generation: int = 0
    """The job's generations as the supervisor tracks them (see WorkerSupervisor)."""
    stop_requested: str | None = None
    """Why the supervisor asked the worker to stop, if it did."""
    exit_code: int | None = None
    """Its exit status, once the supervisor that started it reaped it."""
    announced_exit: int | None = None
    """The code its "exiting" event announced, if it wrote one."""
    announced_user_error: UserError | None = None
    """What its "exiting" event said the job's own code raised, if it did."""
    last_step: int | None = None
    total_steps: int | None = None


class RecordStore:
    """The records and output files under `directory` (created if missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def output_path(self, stem: str) -> Path:
        return self.directory / f"{stem}{OUTPUT_SUFFIX}"

    def save(self, stem: str, record: WorkerRecord) -> None:
        """Replaces the record of `stem` atomically. Raises OSError."""
        path = self.directory / f"{stem}{RECORD_SUFFIX}"
        scratch = path.with_suffix(".tmp")
        scratch.write_text(record.model_dump_json())
        os.replace(scratch, path)

    def remove(self, stem: str) -> None:
        """Deletes the record and the output file of `stem`, if they are there."""
        for suffix in (RECORD_SUFFIX, OUTPUT_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{stem}{suffix}").unlink()

    def load(self) -> dict[str, WorkerRecord]:
        """Returns every record by stem. One that does not parse is logged and removed."""
        records: dict[str, WorkerRecord] = {}
        for path in sorted(self.directory.glob(f"*{RECORD_SUFFIX}")):
            stem = path.name.removesuffix(RECORD_SUFFIX)
            try:
                records[stem] = WorkerRecord.model_validate_json(path.read_text())
            except (OSError, ValidationError) as err:
                log.error("dropping the unreadable worker record %s: %s", path, err)
                self.remove(stem)
        return records


def process_start_time(pid: int) -> int | None:
    """Returns the start time of process `pid` in clock ticks since boot, or None if there is no
    such live process (none, an exited one not yet reaped, or /proc cannot say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields and fields[0] in ("Z", "X"):
        # Exited, waiting to be reaped by whoever adopted the orphan (pid 1 may never do it).
        return None
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def open_process(pid: int, start_time: int | None) -> int | None:
    """Returns a pidfd of process `pid` if it is alive and started at `start_time`, else None.
    The pidfd keeps naming that process even once the pid is reused, so it is safe to signal
    through and to wait on (readable once the process has exited)."""
    if start_time is None:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None
    # Checked after opening: a pid reused before the open shows another start time; one reused
    # after it cannot affect the pidfd.
    if process_start_time(pid) != start_time:
        os.close(pidfd)
        return None
    return pidfd
