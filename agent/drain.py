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
TIME_LIMIT_MARGIN_S = 30.0
"""A SIGTERM this close to the Slurm job's end time (less its signal's lead) is its time limit."""


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
    """What a SIGTERM to this agent means: in a Slurm job, its time limit if the job's end time
    is within `signal_lead_s` (how long before its end Slurm signals it: `--signal=B:TERM@N`)
    and a margin, else a preemption; in a Kubernetes pod, an eviction; elsewhere the agent is
    simply being stopped. `run` runs a Slurm command and returns its output."""
    if environ.get("SLURM_JOB_ID"):
        end = slurm_end_time(environ["SLURM_JOB_ID"], run or _run_slurm)
        if end is not None and end - now() <= signal_lead_s + TIME_LIMIT_MARGIN_S:
            return "slurm_time_limit"
        return "slurm_preemption"
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return "pod_eviction"
    return "agent_stop"


def slurm_end_time(job_id: str, run: Callable[[list[str]], str]) -> float | None:
    """The Slurm job's end time (Unix), from squeue; None if squeue does not answer or the job
    has none (no time limit)."""
    try:
        text = run(["squeue", "--noheader", "--jobs", job_id, "--format", "%e"]).strip()
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("could not read the end time of Slurm job %s: %s", job_id, err)
        return None
    try:
        return datetime.fromisoformat(text.splitlines()[0]).timestamp() if text else None
    except ValueError:
        return None  # "N/A", "Unknown": no time limit


def _run_slurm(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=SLURM_QUERY_TIMEOUT_S, check=True).stdout
