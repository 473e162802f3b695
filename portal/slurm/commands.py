"""Slurm's commands as the pool calls them: `sbatch --parsable` (the script on stdin),
`squeue --json`, `scancel` (after `scontrol update` of the job's comment, where it says why). Each call is bounded in time, and every failure (a non-zero exit,
a timeout, a command that cannot run, output that cannot be read) is one SlurmCommandError
naming the command, its exit code and its stderr.

`squeue --json` is there from 21.08. When it cannot reach slurmctld, 22.05's exits 0 with
`"jobs": []` and an entry in `"errors"`: that is a failed command here, never an empty queue (a
pool that took it for one would forget its agent jobs and submit them again). In 22.05 (data_parser v0.0.38) it ignores the filters
--name, --user, --me and --jobs, and the default one on states: it lists every job of the
cluster, those that ended within MinJobAge too. The pool's jobs are picked here, by name, user
and a state that is not final. The shape read is 22.05's, where a job's state is a string and its times
Unix seconds; later versions give a list of states and times as {"set", "number"} objects, and
both are read (`_state`, `_time`)."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
"""States of a job that waits for resources (or to be queued again)."""
STARTED_STATES = frozenset({"RUNNING", "CONFIGURING"})
"""States of a job that holds its allocation and runs (CONFIGURING: its nodes boot)."""
FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "REVOKED", "SPECIAL_EXIT", "TIMEOUT",
})
"""States of a job that has ended (PREEMPTED: cancelled by a preemption; a requeued one is PENDING)."""


class SlurmCommandError(Exception):
    """A Slurm command failed. `returncode` is None when it did not end (timeout) or could not
    start."""

    def __init__(self, command: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr.strip()
        how = "timed out or could not run" if returncode is None else f"exited {returncode}"
        super().__init__(f"{' '.join(self.command)} {how}: {self.stderr or 'no message'}")


@dataclass(frozen=True)
class SlurmJob:
    """A job as squeue lists it."""

    job_id: int
    name: str
    user: str
    state: str
    """RUNNING, PENDING, COMPLETING, ... (the first state where Slurm lists several)."""
    reason: str
    batch_host: str
    """The node its batch script runs on; "" until it starts."""
    submit_time: float
    start_time: float | None
    """When it started, or None if it has not (a pending job's is Slurm's estimate)."""

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def started(self) -> bool:
        return self.state in STARTED_STATES


def _state(value: Any) -> str:
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value or "")


def _time(value: Any) -> float | None:
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _errors_text(errors: Any) -> str:
    """squeue --json's "errors" entries as one line ("source: description (error)", ...)."""
    if not isinstance(errors, list):
        return repr(errors)[:500]
    parts = []
    for entry in errors:
        if isinstance(entry, dict):
            where = entry.get("source") or "squeue"
            parts.append(f"{where}: {entry.get('description') or entry.get('error') or entry}"
                         f" (error {entry.get('error_number', '?')}: {entry.get('error', '')})")
        else:
            parts.append(str(entry))
    return "; ".join(parts)[:500]


class SlurmCommands:
    """Runs Slurm's client commands with `environ` (default: this process's, where SLURM_CONF
    or the default /etc/slurm/slurm.conf names the cluster), each within `timeout_s`."""

    def __init__(self, timeout_s: float, environ: Mapping[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.environ = dict(environ) if environ is not None else None

    def _run(self, command: Sequence[str], stdin: str | None = None) -> str:
        """Returns the command's stdout; raises SlurmCommandError."""
        try:
            done = subprocess.run(
                list(command), input=stdin, capture_output=True, text=True, timeout=self.timeout_s,
                env=self.environ, stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as err:
            stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
            raise SlurmCommandError(command, None, f"no answer within {self.timeout_s:g} s. {stderr}") from None
        except OSError as err:
            raise SlurmCommandError(command, None, str(err)) from None
        if done.returncode != 0:
            raise SlurmCommandError(command, done.returncode, done.stderr)
        return done.stdout

    def sbatch(self, options: Sequence[str], script: str) -> int:
        """Submits `script` (its text) with `options`; returns the job id."""
        command = ["sbatch", "--parsable", *options]
        out = self._run(command, stdin=script).strip()
        job_id = out.split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
        if not job_id.isdigit():
            raise SlurmCommandError(command, 0, f"not a job id on stdout: {out!r}")
        return int(job_id)

    def jobs(self, name: str, user: str) -> list[SlurmJob]:
        """The jobs not ended yet (pending, running, completing, ...) that are named `name` and
        belong to `user`, by id."""
        command = ["squeue", "--json"]
        out = self._run(command)
        try:
            answer = json.loads(out)
            errors = answer.get("errors") or []
            listed = answer["jobs"]
            found = [
                SlurmJob(
                    job_id=int(job["job_id"]),
                    name=str(job["name"]),
                    user=str(job.get("user_name", "")),
                    state=_state(job["job_state"]),
                    reason=str(job.get("state_reason", "")),
                    batch_host=str(job.get("batch_host") or ""),
                    submit_time=_time(job.get("submit_time")) or 0.0,
                    start_time=_time(job.get("start_time")) if _state(job["job_state"]) in STARTED_STATES else None,
                )
                for job in listed
                if job.get("name") == name and job.get("user_name") == user
                and _state(job["job_state"]) not in FINAL_STATES
            ]
        except (ValueError, KeyError, TypeError) as err:
            raise SlurmCommandError(command, 0, f"output not understood ({err!r}): {out[:200]!r}") from None
        if errors:
            raise SlurmCommandError(command, 0, f"its answer lists errors, not the queue: {_errors_text(errors)}")
        return sorted(found, key=lambda job: job.job_id)

    def scancel(self, job_ids: Sequence[int], comment: str = "") -> None:
        """Cancels the jobs (a job already gone is no error). With `comment`, it is set on each
        job first (`scontrol update`), where the job's batch script reads why it is cancelled
        (squeue's %k) when its TERM comes."""
        if not job_ids:
            return
        for job_id in job_ids if comment else ():
            try:
                self._run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"])
            except SlurmCommandError as err:
                # Ended meanwhile, or a comment refused: the cancel matters, the comment only says why.
                log.warning("could not comment Slurm job %d before cancelling it: %s", job_id, err)
        self._run(["scancel", *(str(job_id) for job_id in job_ids)])
