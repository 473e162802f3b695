"""Membership generations of a job: the phases of a generation's life (api.GenerationPhase),
the board on which the portal publishes them and the workers meet (api.Board; in Redis:
redis.RedisBoard), the rule that composes a generation's record from a plan (compose), and the
codec of the events a worker writes on its stdout (codec)."""

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
