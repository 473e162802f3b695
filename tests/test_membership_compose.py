"""The rule that composes a generation's membership (elastic.membership.compose), which the portal
and LocalJob share: holders of the training state keep the lowest ranks in their rank order, the
others follow in the plan's order; a member is a joiner unless a holder runs on its device; with
no member holding the state, the first holder is the donor; rank 0's node is where the group
meets; virtual workers follow the members' ranks."""

from __future__ import annotations

import pytest

from elastic.membership.compose import Seat, compose_membership, holders_first
from elastic.wire import Member


def seat(node: str, index: int) -> Seat:
    return Seat(node, index, f"10.0.0.{ord(node[-1]) - ord('a') + 1}")


def test_holders_take_the_lowest_ranks_in_their_rank_order_the_others_follow_in_the_plans_order() -> None:
    assert holders_first([5, 1, 7, 3, 9], {3: 0, 7: 1}) == [3, 7, 5, 1, 9]
    assert holders_first([5, 1, 7, 3, 9], {7: 0, 3: 1}) == [7, 3, 5, 1, 9]


def test_without_holders_the_plans_order_stands() -> None:
    assert holders_first([4, 2, 8], {}) == [4, 2, 8]


def test_a_holder_outside_the_plan_takes_no_rank_and_equal_ranks_keep_the_plans_order() -> None:
    assert holders_first([4, 2, 8], {6: 0, 8: 1}) == [8, 4, 2]
    assert holders_first([4, 2, 8], {8: 3, 2: 3}) == [2, 8, 4]


def test_a_first_generation_is_all_joiners_meeting_at_rank_0s_node() -> None:
    record = compose_membership(7, 1, [seat("node-b", 0), seat("node-a", 1)], [], master_port=29500)
    assert record.job_id == 7 and record.generation == 1 and record.master_port == 29500
    assert record.keys() == ["node-b/0", "node-a/1"]
    assert all(member.joiner for member in record.members)
    assert record.master_addr == "10.0.0.2" and not record.has_state and record.donor is None
    assert record.virtual_workers is None and record.global_batch is None


def test_members_on_a_holders_device_are_survivors_the_others_joiners() -> None:
    record = compose_membership(
        7,
        4,
        [seat("node-a", 2), seat("node-b", 0), seat("node-a", 0)],
        [seat("node-a", 2), seat("node-a", 3)],
        master_port=29501,
    )
    assert [(m.key, m.joiner) for m in record.members] == [
        ("node-a/2", False),
        ("node-b/0", True),
        ("node-a/0", True),
    ]
    assert record.has_state and record.donor is None, "a member holds the state: no donor"


def test_with_no_member_holding_the_state_the_first_holder_hands_it_over() -> None:
    record = compose_membership(
        7, 5, [seat("node-b", 1)], [seat("node-a", 3), seat("node-a", 0)], master_port=29502
    )
    assert record.members == [Member(node="node-b", device_index=1, address="10.0.0.2", joiner=True)]
    assert record.has_state
    assert record.donor == Member(node="node-a", device_index=3, address="10.0.0.1", joiner=False)


def test_virtual_workers_follow_the_members_ranks() -> None:
    seats = [seat("node-a", 1), seat("node-a", 0)]
    record = compose_membership(
        7, 2, seats, [], master_port=29503, virtual_workers={"node-a/0": 3, "node-a/1": 5}
    )
    assert record.virtual_workers == [5, 3]
    assert compose_membership(7, 2, seats, [], master_port=29503, virtual_workers={}).virtual_workers is None
    with pytest.raises(KeyError, match="node-a/0"):
        compose_membership(7, 2, seats, [], master_port=29503, virtual_workers={"node-a/1": 8})


def test_a_hybrid_jobs_global_batch_is_carried() -> None:
    assert compose_membership(7, 3, [seat("node-a", 0)], [], 29504, global_batch=96).global_batch == 96


def test_a_generation_of_no_member_is_refused() -> None:
    with pytest.raises(ValueError, match="generation 3 of job 7 has no member"):
        compose_membership(7, 3, [], [seat("node-a", 0)], master_port=29505)
