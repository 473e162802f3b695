"""The resharding planner, without processes: every row of every tensor reaches its new owner
exactly once, from the worker that held it; a worker never receives rows it held; leavers only
send, joiners only receive; the bytes moved are what the layouts force, and for the common
resizes what a hand count gives. Rows held only by a crashed worker are refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.worker.reshard import (
    Member,
    Membership,
    ShardsLostError,
    TensorLayout,
    plan_reshard,
    shard_rows,
)


@pytest.mark.parametrize("rows", [0, 1, 4, 5, 11, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_the_cut_is_torch_chunk_padded_with_empty_shards(rows: int, world: int) -> None:
    whole = torch.arange(rows)
    chunks = list(torch.chunk(whole, world)) if rows else []
    for rank in range(world):
        start, stop = shard_rows(rows, world, rank)
        expected = chunks[rank] if rank < len(chunks) else whole[:0]
        assert torch.equal(whole[start:stop], expected), (rank, start, stop)


@st.composite
def resizes(draw: st.DrawFn) -> tuple[list[TensorLayout], Membership]:
    """Any tensors, any old and new world, survivors mapped to any new ranks, the other new
    ranks joiners, the other old ranks leavers that hand over, in a shuffled group order."""
    layouts = draw(
        st.lists(
            st.builds(
                TensorLayout,
                shape=st.tuples(st.integers(0, 40), st.integers(1, 3)),
                dtype=st.sampled_from([torch.float32, torch.float16, torch.int64]),
            ),
            min_size=1,
            max_size=5,
        )
    )
    old_world = draw(st.integers(1, 6))
    new_world = draw(st.integers(1, 6))
    survivors = draw(st.lists(st.integers(0, old_world - 1), unique=True, max_size=min(old_world, new_world)))
    new_ranks = draw(st.permutations(range(new_world)))
    pairs: list[tuple[int | None, int | None]] = list(zip(survivors, new_ranks, strict=False))
    pairs += [(None, new) for new in new_ranks[len(survivors) :]]
    pairs += [(old, None) for old in range(old_world) if old not in survivors]
    group = draw(st.permutations(range(len(pairs))))
    members = tuple(Member(rank, old, new) for rank, (old, new) in zip(group, pairs, strict=True))
    return layouts, Membership(old_world, new_world, members)


@settings(max_examples=300, deadline=None)
@given(resizes())
def test_every_row_lands_on_its_new_owner_once_and_only_where_it_was_missing(
    case: tuple[list[TensorLayout], Membership],
) -> None:
    layouts, membership = case
    plan = plan_reshard(layouts, membership)
    by_rank = {m.rank: m for m in membership.members}
    for index, layout in enumerate(layouts):
        for member in membership.members:
            arrived = sorted(
                (move.start, move.stop, move.source)
                for move in (*plan.sends, *plan.keeps)
                if move.tensor == index and move.target == member.rank
            )
            rows = [row for start, stop, _ in arrived for row in range(start, stop)]
            if member.new_rank is None:
                assert rows == [], "a leaver receives nothing"
                continue
            start, stop = shard_rows(layout.rows, membership.new_world, member.new_rank)
            assert rows == list(range(start, stop)), "each row of the new shard exactly once"
            for first, last, source in arrived:
                held = by_rank[source].old_rank
                assert held is not None, "a joiner sends nothing"
                old_start, old_stop = shard_rows(layout.rows, membership.old_world, held)
                assert old_start <= first < last <= old_stop, "the source held what it sends"
    for move in plan.sends:
        assert move.source != move.target
        target = by_rank[move.target]
        if target.old_rank is not None:
            old_start, old_stop = shard_rows(layouts[move.tensor].rows, membership.old_world, target.old_rank)
            assert move.stop <= old_start or move.start >= old_stop, "nothing sent to a rank that holds it"
    # Each byte crosses once: what moves is the new cut less what each member kept.
    needed = sum(layout.rows * layout.row_bytes for layout in layouts)
    assert plan.bytes_moved + plan.bytes_kept == needed
    kept = 0
    for layout in layouts:
        for member in membership.members:
            if member.old_rank is None or member.new_rank is None:
                continue
            a = shard_rows(layout.rows, membership.old_world, member.old_rank)
            b = shard_rows(layout.rows, membership.new_world, member.new_rank)
            kept += max(0, min(a[1], b[1]) - max(a[0], b[0])) * layout.row_bytes
    assert plan.bytes_kept == kept


def _membership(old_world: int, new_world: int, survivors: dict[int, int]) -> Membership:
    """Group ranks: survivors and leavers by old rank, then joiners by new rank."""
    members = [Member(old, old, survivors.get(old)) for old in range(old_world)]
    taken = set(survivors.values())
    members += [
        Member(old_world + index, None, new)
        for index, new in enumerate(n for n in range(new_world) if n not in taken)
    ]
    return Membership(old_world, new_world, tuple(members))


ROWS = 1200  # divisible by 2, 3 and 4: the hand counts below are exact
LAYOUTS = [TensorLayout((ROWS, 8), torch.float32), TensorLayout((ROWS,), torch.float32)]
ROW_BYTES = 8 * 4 + 4


@pytest.mark.parametrize(
    ("old_world", "new_world", "survivors", "moved_rows"),
    [
        # 2->3: new 1 needs [400, 600) from old 0; new 2 needs [800, 1200) from old 1.
        (2, 3, {0: 0, 1: 1}, 600),
        # 3->2, old 2 leaves: new 0 needs [400, 600) from old 1; new 1 [800, 1200) from old 2.
        (3, 2, {0: 0, 1: 1}, 600),
        # 4->2, old 2 and 3 leave: new 0 needs [300, 600) from old 1; new 1 all its 600 rows.
        (4, 2, {0: 0, 1: 1}, 900),
        # 4->2 keeping old 0 and 2: each new rank already has half its rows.
        (4, 2, {0: 0, 2: 1}, 600),
        # A migration (old 1 replaced by a joiner): the joiner gets old 1's rows, nothing else moves.
        (2, 2, {0: 0}, 600),
    ],
)
def test_bytes_moved_match_the_hand_count(
    old_world: int, new_world: int, survivors: dict[int, int], moved_rows: int
) -> None:
    plan = plan_reshard(LAYOUTS, _membership(old_world, new_world, survivors))
    assert plan.bytes_moved == moved_rows * ROW_BYTES
    assert plan.bytes_kept == (ROWS - moved_rows) * ROW_BYTES
    leavers = [old for old in range(old_world) if old not in survivors]
    assert all(move.target not in leavers for move in plan.sends)
    assert plan.describe().splitlines()[-1] == (
        f"kept in place: {(ROWS - moved_rows) * ROW_BYTES} B; moved: {moved_rows * ROW_BYTES} B"
    )


def test_the_plan_says_who_sends_what() -> None:
    plan = plan_reshard(LAYOUTS, _membership(2, 3, {0: 0, 1: 1}))
    assert plan.describe().splitlines() == [
        f"rank 0 -> rank 1: {200 * ROW_BYTES} B in 2 row ranges of 2 tensors",
        f"rank 1 -> rank 2: {400 * ROW_BYTES} B in 2 row ranges of 2 tensors",
        f"kept in place: {600 * ROW_BYTES} B; moved: {600 * ROW_BYTES} B",
    ]


def test_rows_held_only_by_a_crashed_worker_are_lost_by_name() -> None:
    # Old rank 1 crashed: no member held its rows, and new rank 1 needs some of them.
    membership = Membership(2, 2, (Member(0, 0, 0), Member(1, None, 1)))
    with pytest.raises(ShardsLostError, match=r"tensor 0 rows \[600, 1200\) of old rank 1") as raised:
        plan_reshard(LAYOUTS, membership)
    assert [(t, a, b, r) for t, a, b, r in raised.value.lost] == [(0, 600, 1200, 1), (1, 600, 1200, 1)]
    # A crashed rank whose shards were empty loses nothing.
    tiny = [TensorLayout((1, 3), torch.float32)]
    assert plan_reshard(tiny, Membership(2, 1, (Member(0, 0, 0),))).bytes_moved == 0


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ((Member(0, 0, 0), Member(0, 1, 1)), "group ranks"),
        ((Member(0, 0, 0), Member(1, 0, 1)), "old ranks"),
        ((Member(0, 0, 0), Member(1, 2, 1)), "old ranks"),
        ((Member(0, 0, 0), Member(1, 1, None)), "new ranks"),
        ((Member(0, 0, 1), Member(1, 1, 1)), "new ranks"),
    ],
)
def test_a_membership_that_does_not_add_up_is_refused(members: tuple[Member, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Membership(2, 2, members)


def test_a_scalar_is_not_sharded() -> None:
    with pytest.raises(ValueError, match="scalar"):
        TensorLayout((), torch.float32)
