"""Where one worker stands in its job between two steps: the generation whose group it is in,
its rank there, the steps it completed, and whether it holds the training state. The rendezvous,
the restore and the training loop (elastic.worker.rendezvous, .restore, .loop) each read it and
change their part of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.wire import Membership


@dataclass
class WorkerPosition:
    rank: int
    """Its rank in its group; the rank it was launched with until it joins one."""
    step: int = 0
    """Steps completed: the training state it holds is that after this many steps."""
    holds_state: bool = False
    """It holds the training state (it was in a group that had it); a joiner does not yet."""
    membership: Membership | None = None
    """The generation whose group it is in, or None between groups."""
    group: list[str] = field(default_factory=list)
    """The member keys of the last group it was in."""
    last_step_end: float | None = None
    """Wall-clock end of its last step."""

    @property
    def is_leader(self) -> bool:
        """It is rank 0 of a group (not merely the lowest rank of the last one)."""
        return self.membership is not None and self.rank == 0
