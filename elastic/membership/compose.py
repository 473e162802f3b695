"""How a generation's membership is composed: which device gets which rank, which member is a
joiner, who hands the training state over when no member holds it, where the group meets and
how many virtual workers each member hosts. One rule for everyone who writes a membership
record: the portal (portal.scheduling.cycle ranks a plan's devices, portal.jobs.lifecycle
composes the record it publishes) and elastic.worker.local.LocalJob, which runs a job without the
portal for tests and benchmarks. Pure data in, wire types out.

The rule: the workers that hold the training state keep the lowest ranks, in their current rank
order, so that rank 0, which leads the switch, is a survivor (`holders_first`); the other devices
follow in the plan's order. A member is a joiner unless a worker that holds the state runs on its
device; when every member is a joiner but a worker holds the state elsewhere, the first holder
(by rank) is the donor. Rank 0's node is where the group meets (`compose_membership`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from elastic.wire import Member, Membership, member_key

__all__ = ["Seat", "compose_membership", "holders_first"]

Device = TypeVar("Device", bound=Hashable)


@dataclass(frozen=True)
class Seat:
    """A device a worker of the job runs on, or will: its node, its index there, and the address
    at which the node's workers are reached."""

    node: str
    device_index: int
    address: str

    @property
    def key(self) -> str:
        """The member's name in records (elastic.wire.member_key)."""
        return member_key(self.node, self.device_index)

    def member(self, joiner: bool) -> Member:
        return Member(node=self.node, device_index=self.device_index, address=self.address, joiner=joiner)


def holders_first(devices: Sequence[Device], holder_ranks: Mapping[Device, int]) -> list[Device]:
    """Returns `devices` (the plan's order) in rank order: those whose worker holds the training
    state (the keys of `holder_ranks`, each with its worker's current rank) first, by that rank,
    then the others in the plan's order. Devices of equal rank keep the plan's order."""
    order = {device: index for index, device in enumerate(devices)}
    return sorted(
        devices, key=lambda d: (0, holder_ranks[d], order[d]) if d in holder_ranks else (1, 0, order[d])
    )


def compose_membership(
    job_id: int,
    generation: int,
    seats: Sequence[Seat],
    holders: Sequence[Seat],
    master_port: int,
    virtual_workers: Mapping[str, int] | None = None,
    global_batch: int | None = None,
) -> Membership:
    """Returns the record of generation `generation` of job `job_id` on `seats`, in rank order.
    `holders`: the seats of the running workers that hold the training state, in their rank
    order (members or not). `virtual_workers`: a strict job's virtual workers per member key
    (None or empty: even shares); `global_batch`: a hybrid job's global batch. Raises ValueError
    for no seats, and KeyError for a member that `virtual_workers` leaves out."""
    if not seats:
        raise ValueError(
            f"generation {generation} of job {job_id} has no member: a record names at least one"
        )
    holding = {seat.key for seat in holders}
    members = [seat.member(joiner=seat.key not in holding) for seat in seats]
    donor = holders[0].member(joiner=False) if holders and all(m.joiner for m in members) else None
    return Membership(
        job_id=job_id,
        generation=generation,
        master_addr=seats[0].address,
        master_port=master_port,
        members=members,
        has_state=bool(holders),
        donor=donor,
        virtual_workers=[virtual_workers[seat.key] for seat in seats] if virtual_workers else None,
        global_batch=global_batch,
    )
