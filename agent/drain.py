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
the report loop. `term_cause` tells from the agent's surroundings what a SIGTERM means, and
never claims more than they say: a Slurm TERM it cannot tell apart is "slurm_term".
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from elastic.wire import DRAIN_CAUSES, SLURM_GIVE_BACK_COMMENT, DrainCause, DrainNotice

log = logging.getLogger(__name__)

SLURM_CAUSE_DEADLINE_S = 10.0
"""How long the agent waits for squeue to say why a TERM came, asking again when it fails: a
loaded slurmctld, busy with the very preemption that sent the TERM, may answer late (the suite's
Slurm commands allow 20 s under CI's load) or refuse a query. The drain's deadline counts from
the TERM, not from the answer."""
SLURM_RETRY_PAUSE_S = 0.25
SLURM_SETTLE_S = 3.0
"""How long an answer that says nothing (running, not preempted, its limit far) is asked again:
what the controller records of a preemption may show a moment after its TERM."""
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


SlurmRun = Callable[[list[str], float], str]
"""Runs a Slurm command with a timeout (seconds) and returns its output; raises OSError or
subprocess.SubprocessError (a timeout included) when it fails."""


def term_cause(slurm_job_id: str | None, environ: Mapping[str, str], signal_lead_s: float,
               run: SlurmRun | None = None, now: Callable[[], float] = time.time,
               deadline_s: float = SLURM_CAUSE_DEADLINE_S) -> DrainCause:
    """What a SIGTERM to this agent means: serving Slurm job `slurm_job_id` (agent.slurm.detect),
    what squeue says of that job (see `slurm_term_cause`; asked again on failure for up to
    `deadline_s`); in a Kubernetes pod (`environ`), an eviction; elsewhere the agent is simply
    being stopped."""
    if slurm_job_id:
        ends_at = time.monotonic() + deadline_s
        settles_by = time.monotonic() + min(deadline_s, SLURM_SETTLE_S)
        while True:
            job = slurm_job_at_term(slurm_job_id, run or _run_slurm, ends_at - time.monotonic())
            cause = slurm_term_cause(job, signal_lead_s, now())
            if cause != "slurm_term" or job is None or time.monotonic() + SLURM_RETRY_PAUSE_S >= settles_by:
                break
            time.sleep(SLURM_RETRY_PAUSE_S)  # squeue may not show the preemption yet: ask again
        if cause == "slurm_term":
            log.warning("squeue does not say why Slurm sent TERM: %s", job or "no answer")
        return cause
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return "pod_eviction"
    return "agent_stop"


@dataclass(frozen=True)
class SlurmJobAtTerm:
    """The agent's own Slurm job as squeue lists it when the TERM came."""

    state: str
    limit_at: float | None
    """Its start plus its time limit (Unix); None without a limit."""
    end_at: float | None
    """Slurm's end time for it (Unix): a preemption moves it to the end of the grace."""
    comment: str
    preempted: bool = False
    """Whether squeue shows its PreemptTime (set when Slurm preempts it, at the grace's TERM)."""


def slurm_term_cause(job: SlurmJobAtTerm | None, signal_lead_s: float, now: float) -> DrainCause:
    """Why Slurm sent the TERM, from `job` as squeue gives it at the TERM (None: squeue did not
    answer), never guessed:
    - the portal's pool gives it back (the comment it sets before its scancel): slurm_pool_idle;
    - cancelled (scancel: the job is CANCELLED, or COMPLETING at once): slurm_cancel;
    - running with its PreemptTime set: slurm_preemption;
    - its limit within `signal_lead_s` (`--signal=B:TERM@N`) and a margin: slurm_time_limit;
    - running, its end time moved before its limit (a preemption's grace): slurm_preemption;
    - anything else: slurm_term, a TERM from Slurm it cannot tell apart."""
    if job is None:
        return "slurm_term"
    if job.comment == SLURM_GIVE_BACK_COMMENT:
        return "slurm_pool_idle"
    if job.state in ("CANCELLED", "COMPLETING"):
        return "slurm_cancel"
    if job.state == "RUNNING" and job.preempted:
        return "slurm_preemption"
    if job.limit_at is not None and job.limit_at - now <= signal_lead_s + TIME_LIMIT_MARGIN_S:
        return "slurm_time_limit"
    if job.state == "RUNNING" and job.end_at is not None and (
        job.limit_at is None or job.end_at < job.limit_at - TIME_LIMIT_MARGIN_S
    ):
        return "slurm_preemption"
    return "slurm_term"


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


def _slurm_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:  # "Unknown", "N/A", ""
        return None


def slurm_job_at_term(job_id: str, run: SlurmRun,
                      deadline_s: float = SLURM_CAUSE_DEADLINE_S) -> SlurmJobAtTerm | None:
    """The job `job_id` from squeue (its state, start plus limit, end time, comment and whether it
    was preempted), squeue asked again while it fails, for up to `deadline_s`; None if it never
    answered or lists no such job."""
    ends_at = time.monotonic() + deadline_s
    text = _ask_squeue(["squeue", "--noheader", "--jobs", job_id, "--format", "%T|%S|%l|%e|%k"], run, ends_at)
    if text is None:
        return None
    fields = (text.splitlines() or [""])[0].split("|", 4)
    if len(fields) != 5:
        log.warning("squeue lists no Slurm job %s (it said %r)", job_id, text[:200])
        return None
    state, start, limit, end, comment = fields
    started_at, limit_s = _slurm_time(start), slurm_duration_s(limit)
    return SlurmJobAtTerm(
        state=state.strip(),
        limit_at=started_at + limit_s if started_at is not None and limit_s is not None else None,
        end_at=_slurm_time(end),
        comment=comment.strip(),
        preempted=slurm_preempted(job_id, run, ends_at),
    )


def slurm_preempted(job_id: str, run: SlurmRun, ends_at: float) -> bool:
    """Whether Slurm has preempted the job: its PreemptTime is set (with a GraceTime, from the
    preemption's TERM on; a field of `--Format` only, hence a query of its own). False if
    squeue does not answer by `ends_at` (time.monotonic)."""
    text = _ask_squeue(["squeue", "--noheader", "--jobs", job_id, "--Format", "PreemptTime"], run, ends_at)
    return text is not None and _slurm_time((text.splitlines() or [""])[0]) is not None


def _ask_squeue(command: list[str], run: SlurmRun, ends_at: float) -> str | None:
    """`command`'s output, asked until it answers (at least once, each try given what is left
    until `ends_at`, time.monotonic); None if it never did."""
    started = time.monotonic()
    while True:
        try:
            text = run(command, max(SLURM_RETRY_PAUSE_S, ends_at - time.monotonic())).strip()
        except (OSError, subprocess.SubprocessError) as err:
            if time.monotonic() + SLURM_RETRY_PAUSE_S >= ends_at:
                log.warning("squeue did not answer %s in %.1f s: %s", " ".join(command[1:]),
                            time.monotonic() - started, err)
                return None
            log.info("squeue failed (%s); asking again", err)
            time.sleep(SLURM_RETRY_PAUSE_S)
        else:
            log.info("squeue answered %s in %.1f s", " ".join(command[1:]), time.monotonic() - started)
            return text


def _run_slurm(command: list[str], timeout_s: float) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
