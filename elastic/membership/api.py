"""The life of a membership generation, as both sides of the wire see it: the phases, which
phase may follow which, and the deadline of each. The portal writes a generation's phase
(portal.jobs.lifecycle); workers act on the board (`Board`) in the order the phases give.

    planned    -> published   the record is on the board and each node got its launch
    planned    -> superseded  a newer plan replaced it before it was published
    planned    -> expired     PUBLISH deadline: the job's stopping workers never reported their exit
    planned    -> ended       the job ended (finished, cancelled, failed)
    published  -> formed      every member joined the group and holds the training state
    published  -> expired     WARMUP deadline: a joiner never said it was ready; or FORM deadline:
                              every joiner was ready but the group did not form; or a member
                              reported that the rendezvous failed (form_failed)
    published  -> lost        a member died before the group formed
    published  -> superseded  a newer plan replaced it (a device it needs was taken back)
    published  -> ended
    formed     -> settled     rank 0 reported the resize (its pause), and no leaver is left;
                              SETTLE deadline: leavers still running then are stopped, and it
                              settles without the report
    formed     -> lost        a member died: the survivors hold the state of the last step
    formed     -> superseded  a newer plan replaced it before it settled
    formed     -> ended
    settled    -> lost
    settled    -> superseded  the next resize was planned (the workers train on in it until the
                              newer generation forms)
    settled    -> ended

lost, expired, superseded and ended are final. A job whose newest generation is lost or expired
is planned again from the members that are alive, leaving out the devices whose worker died or
never got ready (if the job can do without them). Nothing waits on a phase without a deadline:
the holders of the state wait for joiners only while the generation is the newest, and the
portal expires it when its deadline passes.
"""

from __future__ import annotations

import abc
import enum

from elastic.transitions import InvalidMove, check_move
from elastic.wire import Member, Membership

__all__ = [
    "Board",
    "BoardUnavailable",
    "GenerationPhase",
    "InvalidPhaseTransition",
    "Member",
    "Membership",
    "PHASE_TRANSITIONS",
    "check_phase_transition",
]


class GenerationPhase(enum.StrEnum):
    PLANNED = "planned"
    PUBLISHED = "published"
    FORMED = "formed"
    SETTLED = "settled"
    LOST = "lost"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"
    ENDED = "ended"

    @property
    def final(self) -> bool:
        return not PHASE_TRANSITIONS[self]

    @property
    def needs_replan(self) -> bool:
        """A job whose newest generation is in this phase must be planned again."""
        return self in (GenerationPhase.LOST, GenerationPhase.EXPIRED)

    @property
    def in_flight(self) -> bool:
        """The generation is on its way to forming: a newer plan waits for it (unless a device
        it needs is gone)."""
        return self in (GenerationPhase.PLANNED, GenerationPhase.PUBLISHED)


_P = GenerationPhase
PHASE_TRANSITIONS: dict[GenerationPhase, frozenset[GenerationPhase]] = {
    _P.PLANNED: frozenset({_P.PUBLISHED, _P.SUPERSEDED, _P.EXPIRED, _P.ENDED}),
    _P.PUBLISHED: frozenset({_P.FORMED, _P.EXPIRED, _P.LOST, _P.SUPERSEDED, _P.ENDED}),
    _P.FORMED: frozenset({_P.SETTLED, _P.LOST, _P.SUPERSEDED, _P.ENDED}),
    _P.SETTLED: frozenset({_P.LOST, _P.SUPERSEDED, _P.ENDED}),
    _P.LOST: frozenset(),
    _P.EXPIRED: frozenset(),
    _P.SUPERSEDED: frozenset(),
    _P.ENDED: frozenset(),
}


class InvalidPhaseTransition(InvalidMove):
    what = "a generation"


def check_phase_transition(source: str, target: str) -> None:
    """Raises InvalidPhaseTransition unless a generation may go from `source` to `target`."""
    check_move(PHASE_TRANSITIONS, GenerationPhase, source, target, InvalidPhaseTransition)


class BoardUnavailable(RuntimeError):  # noqa: N818 - the name the Board docstrings use
    """The store behind a Board did not answer (after the retries its client makes)."""


class Board(abc.ABC):
    """A job's membership board: where the portal publishes each generation's record and where
    joiners and the running group agree on the moment of a switch. Every method raises
    BoardUnavailable if the store does not answer."""

    @abc.abstractmethod
    def publish(self, record: Membership) -> bool:
        """Stores `record` and makes it the latest unless a newer one is; returns whether it
        became the latest."""

    @abc.abstractmethod
    def latest_generation(self) -> int:
        """The newest generation published, or 0."""

    @abc.abstractmethod
    def record(self, generation: int) -> Membership | None:
        """Generation `generation`'s record, or None."""

    def latest(self) -> Membership | None:
        """The newest record, or None."""
        generation = self.latest_generation()
        return self.record(generation) if generation else None

    @abc.abstractmethod
    def mark_ready(self, generation: int, member: str) -> None:
        """The joiner `member` is built and waits for `generation`."""

    @abc.abstractmethod
    def ready(self, generation: int) -> set[str]:
        """The members that said they are ready for `generation`."""

    @abc.abstractmethod
    def send_go(self, generation: int, tokens: int) -> None:
        """Wakes up to `tokens` joiners waiting for `generation`."""

    @abc.abstractmethod
    def wait_go(self, generation: int, timeout_s: float) -> bool:
        """Takes one go token of `generation`, waiting at most `timeout_s`; whether one came."""

    @abc.abstractmethod
    def announce_store(self, generation: int, port: int, tokens: int) -> None:
        """Rank 0 of `generation` says that its store listens at `port`, to up to `tokens`
        members."""

    @abc.abstractmethod
    def wait_store(self, generation: int, timeout_s: float) -> int | None:
        """Takes one store token of `generation`, waiting at most `timeout_s`: the port rank 0's
        store listens at, or None if no token came."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the connection."""
