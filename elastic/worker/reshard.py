"""Moving sharded training state from one generation's layout to the next's, in memory.

A sharded job (`sharding: fsdp`) keeps each parameter, and each optimiser tensor shaped like
one, cut along dim 0 over the generation's N workers as `fully_shard` cuts it: `torch.chunk`
into N pieces of ceil(rows / N) rows, the last ones shorter or empty. When the generation
changes, the same rows must end up cut over the new one. This module plans that move and
carries it out.

- The plan (`plan_reshard`) is a plain value: for every tensor, which rows each member keeps
  (rows it already held and holds again) and which row ranges go from whom to whom. Each row a
  member needs and did not hold is sent to it exactly once, by the one worker that held it, so
  each byte crosses the network once and a survivor never receives what it has. A worker that
  leaves on purpose is a source that receives nothing; a worker that crashed is simply absent,
  and rows only it held cannot be planned (ShardsLostError). `ReshardPlan.describe` prints who
  sends what.
- `execute` runs one rank's part of a plan over a process group that holds every member (the
  new generation, with the leavers that hand over): asynchronous point-to-point sends out of the
  old local shards and receives straight into the new ones, all posted at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Returns the rows [start, stop) of a tensor of `rows` rows (dim 0) that `rank` of `world`
    holds, as `torch.chunk` cuts it: pieces of ceil(rows / world) rows, so the last ranks may
    hold fewer or none. Raises ValueError for a rank outside the world."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class TensorLayout:
    """A sharded tensor as a whole: its full shape and its dtype. The shards of it are rows of
    dim 0."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.shape:
            raise ValueError("a sharded tensor needs at least one dimension; a scalar is replicated")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()

    def local_shape(self, world: int, rank: int) -> tuple[int, ...]:
        start, stop = shard_rows(self.rows, world, rank)
        return (stop - start, *self.shape[1:])

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class Member:
    """A worker taking part in a reshard: `rank` in the process group that carries the move,
    its rank in the old generation (None for a joiner) and in the new one (None for a leaver)."""

    rank: int
    old_rank: int | None
    new_rank: int | None


@dataclass(frozen=True)
class Membership:
    """Who held the shards and who will. An old rank that no member has crashed: its rows are
    gone."""

    old_world: int
    new_world: int
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        ranks = [m.rank for m in self.members]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"group ranks {ranks} repeat")
        old = [m.old_rank for m in self.members if m.old_rank is not None]
        if len(set(old)) != len(old) or any(not 0 <= r < self.old_world for r in old):
            raise ValueError(f"old ranks {old} repeat or are not in an old world of {self.old_world}")
        new = sorted(m.new_rank for m in self.members if m.new_rank is not None)
        if new != list(range(self.new_world)):
            raise ValueError(f"new ranks {new} are not each of 0..{self.new_world - 1} once")

    def holder(self, old_rank: int) -> Member | None:
        """The member that held old rank `old_rank`'s shards, or None if it crashed."""
        return next((m for m in self.members if m.old_rank == old_rank), None)

    def member(self, rank: int) -> Member:
        """The member of group rank `rank`. Raises KeyError if none is."""
        for m in self.members:
            if m.rank == rank:
                return m
        raise KeyError(f"group rank {rank} takes no part in this reshard")


@dataclass(frozen=True)
class RowMove:
    """Rows [start, stop) of tensor number `tensor`, from group rank `source` to `target`. A
    move whose source is its target is a keep: the rows stay in the member's memory."""

    tensor: int
    start: int
    stop: int
    source: int
    target: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class ShardsLostError(RuntimeError):
    """Rows that the new layout needs were held only by workers that are gone (crashed, not
    handed over)."""

    def __init__(self, lost: list[tuple[int, int, int, int]]) -> None:
        self.lost = lost
        shown = ", ".join(f"tensor {t} rows [{a}, {b}) of old rank {r}" for t, a, b, r in lost[:5])
        more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
        super().__init__(f"shards lost with their workers: {shown}{more}")


@dataclass(frozen=True)
class ReshardPlan:
    """Who sends which rows of which tensor to whom (`sends`) and what each member keeps
    (`keeps`), for `layouts` going through `membership`."""

    layouts: tuple[TensorLayout, ...]
    membership: Membership
    sends: tuple[RowMove, ...]
    keeps: tuple[RowMove, ...] = field(default=())

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross the group."""
        return sum(move.rows * self.layouts[move.tensor].row_bytes for move in self.sends)

    @property
    def bytes_kept(self) -> int:
        """Bytes the survivors already held where the new layout wants them."""
        return sum(move.rows * self.layouts[move.tensor].row_bytes for move in self.keeps)

    def describe(self) -> str:
        """One line per pair of ranks that exchange anything (bytes and tensors), then what
        stays, then the total: the planner's account of who sends what."""
        pairs: dict[tuple[int, int], list[RowMove]] = {}
        for move in self.sends:
            pairs.setdefault((move.source, move.target), []).append(move)
        lines = [
            f"rank {source} -> rank {target}: {self._bytes(moves)} B in {len(moves)} row ranges of "
            f"{len({m.tensor for m in moves})} tensors"
            for (source, target), moves in sorted(pairs.items())
        ]
        lines.append(f"kept in place: {self.bytes_kept} B; moved: {self.bytes_moved} B")
        return "\n".join(lines)

    def _bytes(self, moves: list[RowMove]) -> int:
        return sum(move.rows * self.layouts[move.tensor].row_bytes for move in moves)


def plan_reshard(layouts: Sequence[TensorLayout], membership: Membership) -> ReshardPlan:
    """Returns the plan that takes `layouts`, cut over membership.old_world, to the same cut over
    membership.new_world. Every row a new rank needs comes from the member that held it in the
    old cut (fully_shard's shards do not overlap, so there is exactly one); rows it already held
    it keeps. Raises ShardsLostError if needed rows were held by an old rank that no member has."""
    sends: list[RowMove] = []
    keeps: list[RowMove] = []
    lost: list[tuple[int, int, int, int]] = []
    holders = [membership.holder(old) for old in range(membership.old_world)]
    for index, layout in enumerate(layouts):
        for member in membership.members:
            if member.new_rank is None:
                continue
            new_start, new_stop = shard_rows(layout.rows, membership.new_world, member.new_rank)
            for old, holder in enumerate(holders):
                old_start, old_stop = shard_rows(layout.rows, membership.old_world, old)
                start, stop = max(new_start, old_start), min(new_stop, old_stop)
                if start >= stop:
                    continue
                if holder is None:
                    lost.append((index, start, stop, old))
                elif holder.rank == member.rank:
                    keeps.append(RowMove(index, start, stop, member.rank, member.rank))
                else:
                    sends.append(RowMove(index, start, stop, holder.rank, member.rank))
    if lost:
        raise ShardsLostError(lost)
    return ReshardPlan(tuple(layouts), membership, tuple(sends), tuple(keeps))


def new_shards(plan: ReshardPlan, rank: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Empty local shards of the new cut for group rank `rank` (none for a leaver), to receive
    into."""
    member = plan.membership.member(rank)
    if member.new_rank is None:
        return []
    world = plan.membership.new_world
    return [
        torch.empty(layout.local_shape(world, member.new_rank), dtype=layout.dtype, device=device)
        for layout in plan.layouts
    ]


def _rows_of(shard: torch.Tensor, first_row: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the whole tensor, inside `shard`, whose first row is `first_row`:
    a contiguous view, which is what a point-to-point send or receive needs."""
    return shard.narrow(0, start - first_row, stop - start)


def execute(
    plan: ReshardPlan,
    rank: int,
    old: Sequence[torch.Tensor],
    new: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Carries out group rank `rank`'s part of `plan` over `group` (the default group if None):
    copies its keeps from `old` (its local shards of the old cut, empty for a joiner) into `new`
    (its local shards of the new cut, empty for a leaver, e.g. from new_shards), sends the rows
    others need out of `old` and receives its own straight into `new`, every request posted at
    once. Returns once this rank's sends and receives are done. Every member calls it with the
    same plan. Raises ValueError if a local shard has the wrong shape or is not contiguous, and
    what torch.distributed raises if a peer fails."""
    membership = plan.membership
    member = membership.member(rank)
    _check(plan, old, member.old_rank, membership.old_world, "old")
    _check(plan, new, member.new_rank, membership.new_world, "new")

    def old_rows(move: RowMove) -> torch.Tensor:
        assert member.old_rank is not None
        first = shard_rows(plan.layouts[move.tensor].rows, membership.old_world, member.old_rank)[0]
        return _rows_of(old[move.tensor], first, move.start, move.stop)

    def new_rows(move: RowMove) -> torch.Tensor:
        assert member.new_rank is not None
        first = shard_rows(plan.layouts[move.tensor].rows, membership.new_world, member.new_rank)[0]
        return _rows_of(new[move.tensor], first, move.start, move.stop)

    requests = []
    for tag, move in enumerate(plan.sends):
        if move.source == rank:
            requests.append(dist.isend(old_rows(move), group=group, group_dst=move.target, tag=tag))
        elif move.target == rank:
            requests.append(dist.irecv(new_rows(move), group=group, group_src=move.source, tag=tag))
    for move in plan.keeps:
        if move.target == rank:
            new_rows(move).copy_(old_rows(move))
    for request in requests:
        assert request is not None
        request.wait()


def _check(
    plan: ReshardPlan, shards: Sequence[torch.Tensor], shard_rank: int | None, world: int, which: str
) -> None:
    if shard_rank is None:
        return
    if len(shards) != len(plan.layouts):
        raise ValueError(f"{len(shards)} {which} local shards for {len(plan.layouts)} tensors")
    for index, (shard, layout) in enumerate(zip(shards, plan.layouts, strict=True)):
        expected = layout.local_shape(world, shard_rank)
        if tuple(shard.shape) != expected or shard.dtype != layout.dtype or not shard.is_contiguous():
            raise ValueError(
                f"{which} local shard {index} is {tuple(shard.shape)} {shard.dtype}"
                f"{'' if shard.is_contiguous() else ' (not contiguous)'}; rank {shard_rank} of {world} "
                f"holds {expected} {layout.dtype}"
            )
