"""Membership generations of a job: the phases of a generation's life (api.GenerationPhase),
the board on which the portal publishes them and the workers meet (api.Board; in Redis:
redis.RedisBoard), and the rule that composes a generation's record from a plan (compose). The
codec of the events a worker writes on its stdout is the worker's: elastic.worker.event_codec."""

from elastic.membership.api import (
    PHASE_TRANSITIONS,
    Board,
    BoardUnavailable,
    GenerationPhase,
    InvalidPhaseTransition,
    check_phase_transition,
)

__all__ = [
    "PHASE_TRANSITIONS",
    "Board",
    "BoardUnavailable",
    "GenerationPhase",
    "InvalidPhaseTransition",
    "check_phase_transition",
]
