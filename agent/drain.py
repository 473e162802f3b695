"""A node leaving gracefully: the agent's drain.

A cluster engine that takes a machine back asks first: Slurm sends a preempted job, or one at its
time limit, SIGTERM with a grace period (`GraceTime`, `--signal`); Kubernetes evicts a pod with
SIGTERM and `terminationGracePeriodSeconds`. An operator can ask too (`bungee node drain`). On
that word the agent drains instead of stopping its workers: it tells the portal in every report
that its devices leave by a deadline (elastic.wire.DrainNotice), keeps no standby and takes no
new worker; the portal plans the node's jobs without it, so each shrinks in place at its next
step boundary (its workers here leave, the others train on) or, below its minimum, saves its
step and waits in the queue. The agent exits once its workers are gone, or at the deadline,
when it stops what is left (the workers save and exit, as on any stop).

`Drain` holds the one drain of an agent's life: asked once (the earliest deadline wins), read by
the report loop. `term_cause` tells from the agent's surroundings what a SIGTERM means.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

from elastic.wire import DRAIN_CAUSES, DrainCause, DrainNotice

log = logging.getLogger(__name__)

SLURM_QUERY_TIMEOUT_S = 5.0
TIME_LIMIT_MARGIN_S = 90.0
"""A SIGTERM this close to the Slurm job's time limit, beyond its signal's lead, is the limit's:
Slurm may send `--signal` up to 60 s early (its documentation says so) and checks on a 30 s
cycle."""


class Drain:
    """The agent's drain: not asked, asked (with a cause and a deadline), and when it is over.
    Thread-safe: a signal handler or the command reader asks, the report loop reads."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._notice: DrainNotice | None = None

    def ask(self, cause: DrainCause, deadline_s: float) -> DrainNotice:
        """Starts the drain, or brings its deadline nearer; returns the notice now in force. The
        first cause stays: it is why the node leaves."""
        deadline_at = self._clock() + deadline_s
        with self._lock:
            if self._notice is None:
                self._notice = DrainNotice(cause=cause, deadline_at=deadline_at)
                log.warning("draining: %s; the node's devices leave within %.0f s", DRAIN_CAUSES[cause], deadline_s)
            elif deadline_at < self._notice.deadline_at:
                self._notice = self._notice.model_copy(update={"deadline_at": deadline_at})
            return self._notice

    @property
    def notice(self) -> DrainNotice | None:
        with self._lock:
            return self._notice

    def overdue(self) -> bool:
        """Whether the drain's deadline has passed (False while no drain is asked)."""
        notice = self.notice
        return notice is not None and self._clock() >= notice.deadline_at


def term_cause(environ: Mapping[str, str], signal_lead_s: float, run: Callable[[list[str]], str] | None = None,
               now: Callable[[], float] = time.time) -> DrainCause:
    """What a SIGTERM to this agent means: in a Slurm job, its time limit if the limit (the job's
    start plus its time limit: a preemption moves the job's end time to the end of its grace, so
    that is no guide) is within `signal_lead_s` (how long before its end Slurm signals it:
    `--signal=B:TERM@N`) and a margin, else a preemption; in a Kubernetes pod, an eviction;
    elsewhere the agent is simply being stopped. `run` runs a Slurm command and returns its
    output."""
    if environ.get("SLURM_JOB_ID"):
        limit = slurm_time_limit_at(environ["SLURM_JOB_ID"], run or _run_slurm)
        if limit is not None and limit - now() <= signal_lead_s + TIME_LIMIT_MARGIN_S:
            return "slurm_time_limit"
        return "slurm_preemption"
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return "pod_eviction"
    return "agent_stop"


def slurm_duration_s(text: str) -> float | None:
    """Seconds of a Slurm duration ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM",
    "D-HH:MM:SS"); None for "UNLIMITED", "INFINITE", "N/A" or anything else."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not all(part.isdigit() for part in parts) or (days and not days.isdigit()) or not 1 <= len(parts) <= 3:
        return None
    numbers = [int(part) for part in parts]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (numbers + [0, 0])[:3]
    elif len(numbers) == 3:
        hours, minutes, seconds = numbers
    else:  # MM or MM:SS
        hours, (minutes, seconds) = 0, (numbers + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def slurm_time_limit_at(job_id: str, run: Callable[[list[str]], str]) -> float | None:
    """When the Slurm job reaches its time limit (Unix): its start plus its limit, from squeue;
    None if squeue does not answer or the job has no limit."""
    try:
        text = run(["squeue", "--noheader", "--jobs", job_id, "--format", "%S|%l"]).strip()
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("could not read the time limit of Slurm job %s: %s", job_id, err)
        return None
    start, _, limit = (text.splitlines() or [""])[0].partition("|")
    seconds = slurm_duration_s(limit)
    try:
        return datetime.fromisoformat(start).timestamp() + seconds if seconds is not None else None
    except ValueError:
        return None


def _run_slurm(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=SLURM_QUERY_TIMEOUT_S, check=True).stdout
