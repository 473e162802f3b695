"""The job state machine.

    queued     -> running      the scheduler gave it devices and its workers were launched
    queued     -> cancelled    its owner cancelled it before it ran
    running    -> resizing     its devices changed: a new generation is published, its joiners
                               warm up while the running workers go on training
    running    -> queued       it lost every device (owner came back, node lost) and waits
    running    -> succeeded    its workers trained every step
    running    -> failed       its workers failed more often than MAX_RESTARTS, or its own code
                               failed (a user error: never restarted)
    running    -> cancelled
    resizing   -> running      rank 0 reported that the newest generation took over (its resize
                               event, with the pause it cost)
    resizing   -> queued       it lost every device while resizing
    resizing   -> succeeded    the last step finished while the resize was under way
    resizing   -> failed
    resizing   -> cancelled

succeeded, failed and cancelled are final. Any other transition raises InvalidTransition;
`claim` moves a job only if it is still in the state the caller read (a conditional UPDATE), so
that a task delivered twice cannot move it twice.
"""

from __future__ import annotations

from django.db import models

from elastic.transitions import InvalidMove, check_move


class JobState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    RESIZING = "resizing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.RESIZING, JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RESIZING: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

ACTIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.RESIZING})
FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class InvalidTransition(InvalidMove):
    what = "a job"


def check_transition(source: str, target: str) -> None:
    """Raises InvalidTransition unless the state machine allows source -> target."""
    check_move(TRANSITIONS, JobState, source, target, InvalidTransition)
