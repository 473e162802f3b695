"""The Slurm pool's sizing decision (portal.slurm.sizing), a pure function: properties over any
demand, cluster, pool and limits, and the cases that name the rules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portal.slurm.sizing import AgentJob, Phase, PoolDecision, PoolLimits, size_pool

LIMITS = PoolLimits(devices_per_agent=2, max_agents=4, idle_s=600, start_timeout_s=300)


@st.composite
def pools(draw: st.DrawFn) -> tuple[int, int, list[AgentJob], PoolLimits]:
    limits = PoolLimits(
        devices_per_agent=draw(st.integers(1, 8)),
        max_agents=draw(st.integers(0, 10)),
        idle_s=draw(st.sampled_from([0.0, 60.0, 600.0])),
        start_timeout_s=draw(st.sampled_from([0.0, 120.0, 600.0])),
    )
    ids = draw(st.lists(st.integers(1, 10_000), unique=True, max_size=12))
    agents = [
        AgentJob(
            slurm_job_id=job_id,
            phase=(phase := draw(st.sampled_from(list(Phase)))),
            idle_for_s=draw(st.sampled_from([0.0, 30.0, 200.0, 1000.0])),
            usable_devices=draw(st.integers(0, limits.devices_per_agent)) if phase == Phase.ONLINE else 0,
        )
        for job_id in ids
    ]
    online_devices = sum(a.usable_devices for a in agents)
    usable = online_devices + draw(st.integers(0, 16))  # the pool's and the fixed nodes'
    wanted = draw(st.integers(0, 40))
    return wanted, usable, agents, limits


def _applied(agents: list[AgentJob], decision: PoolDecision, start_id: int) -> list[AgentJob]:
    kept = [a for a in agents if a.slurm_job_id not in decision.cancel]
    return kept + [AgentJob(start_id + i, Phase.PENDING) for i in range(decision.submit)]


@settings(max_examples=400, deadline=None)
@given(pools())
def test_the_decision_keeps_the_pools_rules(pool: tuple[int, int, list[AgentJob], PoolLimits]) -> None:
    wanted, usable, agents, limits = pool
    decision = size_pool(wanted, usable, agents, limits)
    by_id = {a.slurm_job_id: a for a in agents}
    unmet = max(0, wanted - usable)
    needed = math.ceil(unmet / limits.devices_per_agent)

    assert decision.submit >= 0 and set(decision.cancel) <= set(by_id)
    assert decision.unmet_devices == unmet
    for job_id in decision.cancel:
        agent = by_id[job_id]
        # Only an idle agent, one that never registered, or a pending one goes; never one leaving.
        assert agent.phase != Phase.LEAVING
        if agent.phase == Phase.ONLINE:
            assert agent.idle_for_s >= limits.idle_s
        if agent.phase == Phase.STARTING:
            assert agent.idle_for_s >= limits.start_timeout_s

    after = _applied(agents, decision, start_id=20_000)
    pending_after = sum(1 for a in after if a.phase == Phase.PENDING)
    coming_after = sum(1 for a in after if a.phase in (Phase.PENDING, Phase.STARTING))
    assert pending_after <= needed, "never more pending agent jobs than the demand"
    staying_after = sum(1 for a in after if a.phase != Phase.LEAVING)
    if decision.submit:
        assert staying_after <= limits.max_agents
        assert coming_after <= needed
    else:
        # Nothing submitted: the demand is covered by agents on their way, or the pool is full.
        assert coming_after >= needed or staying_after >= limits.max_agents
    if unmet == 0:
        assert decision.submit == 0
    # Cancelling idle agents never takes the cluster below what the jobs want.
    usable_after = usable - sum(by_id[j].usable_devices for j in decision.cancel if by_id[j].phase == Phase.ONLINE)
    assert usable_after >= min(usable, wanted)


@settings(max_examples=300, deadline=None)
@given(pools())
def test_deciding_again_on_the_result_changes_nothing(pool: tuple[int, int, list[AgentJob], PoolLimits]) -> None:
    wanted, usable, agents, limits = pool
    first = size_pool(wanted, usable, agents, limits)
    by_id = {a.slurm_job_id: a for a in agents}
    usable_after = usable - sum(by_id[j].usable_devices for j in first.cancel if by_id[j].phase == Phase.ONLINE)
    second = size_pool(wanted, usable_after, _applied(agents, first, start_id=20_000), limits)
    assert second == PoolDecision(submit=0, cancel={}, unmet_devices=second.unmet_devices)


def test_demand_beyond_the_cluster_submits_whole_agents_up_to_the_maximum() -> None:
    assert size_pool(5, 0, [], LIMITS).submit == 3  # 5 devices: three agents of 2
    assert size_pool(50, 0, [], LIMITS).submit == 4  # the maximum
    assert size_pool(4, 4, [], LIMITS).submit == 0


def test_agents_on_their_way_count_and_pending_ones_beyond_the_demand_go() -> None:
    on_their_way = [AgentJob(1, Phase.STARTING, idle_for_s=10), AgentJob(2, Phase.PENDING), AgentJob(3, Phase.PENDING)]
    assert size_pool(6, 0, on_their_way, LIMITS) == PoolDecision(submit=0, cancel={}, unmet_devices=6)
    fewer = size_pool(2, 0, on_their_way, LIMITS)
    assert fewer.submit == 0 and set(fewer.cancel) == {2, 3}
    assert "pending beyond the demand" in fewer.cancel[3]


def test_an_agent_that_never_registers_is_cancelled_and_replaced() -> None:
    decision = size_pool(2, 0, [AgentJob(7, Phase.STARTING, idle_for_s=301)], LIMITS)
    assert set(decision.cancel) == {7} and "has not registered" in decision.cancel[7]
    assert decision.submit == 1


def test_idle_agents_go_only_while_the_cluster_can_spare_their_devices() -> None:
    idle = [AgentJob(1, Phase.ONLINE, idle_for_s=900, usable_devices=2),
            AgentJob(2, Phase.ONLINE, idle_for_s=700, usable_devices=2)]
    assert set(size_pool(0, 4, idle, LIMITS).cancel) == {1, 2}
    assert set(size_pool(2, 4, idle, LIMITS).cancel) == {1}  # the longest idle
    assert size_pool(4, 4, idle, LIMITS).cancel == {}
    busy = [AgentJob(3, Phase.ONLINE, idle_for_s=10, usable_devices=2)]
    assert size_pool(0, 2, busy, LIMITS).cancel == {}


def test_one_device_per_agent_at_least() -> None:
    with pytest.raises(ValueError, match="devices_per_agent=0"):
        size_pool(1, 0, [], PoolLimits(devices_per_agent=0, max_agents=1, idle_s=0, start_timeout_s=0))


def test_an_agent_that_leaves_is_replaced_at_once_within_the_maximum() -> None:
    """Its node drains (preempted, at its time limit): the replacement is pending in Slurm by the
    time the leaving agent's devices are free, even at the most agent jobs."""
    limits = PoolLimits(devices_per_agent=1, max_agents=2, idle_s=600, start_timeout_s=300)
    agents = [AgentJob(1, Phase.ONLINE, usable_devices=1), AgentJob(2, Phase.LEAVING)]
    assert size_pool(2, 1, agents, limits) == PoolDecision(submit=1, cancel={}, unmet_devices=1)
    assert size_pool(2, 1, [*agents, AgentJob(3, Phase.PENDING)], limits).submit == 0
