"""The baselines behave like the schedulers they stand for, and the registry finds them."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.scheduling import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ClusterSnapshot,
    JobView,
    UnknownPolicyError,
    get_policy,
)
from elastic.scheduling.baselines import TiresiasConfig, fifo, optimus, tiresias
from elastic.scheduling.goodput_policy import GoodputPolicy
from tests.policy_cases import SCALES_WELL, counts, devices, hybrid_job


def gang(job_id: int, size: int, **fields: Any) -> JobView:
    base = dict(requested_workers=size, consistency="strict", gradient_noise=None, max_workers=16)
    base.update(fields)
    return hybrid_job(job_id, SCALES_WELL, **base)


def test_fifo_gives_the_gang_and_blocks_behind_the_first_that_does_not_fit() -> None:
    running = gang(1, 2, current=(0, 1))
    big = gang(2, 4)
    small = gang(3, 1)
    assert counts(fifo(ClusterSnapshot(devices(4), (running, big, small)))) == {1: 2, 2: 0, 3: 0}
    assert counts(fifo(ClusterSnapshot(devices(6), (running, big, small)))) == {1: 2, 2: 4, 3: 0}


def test_fifo_never_preempts_a_running_job() -> None:
    late_but_running = gang(2, 4, submitted_at=10.0, current=(0, 1, 2, 3))
    early = gang(1, 4, submitted_at=0.0)
    assert counts(fifo(ClusterSnapshot(devices(4), (early, late_but_running)))) == {1: 0, 2: 4}


def test_tiresias_demotes_jobs_past_the_threshold_and_skips_what_does_not_fit() -> None:
    threshold = TiresiasConfig().queue_threshold_s
    veteran = gang(1, 2, current=(0, 1), attained_service_s=threshold + 1)
    newcomer = gang(2, 2, submitted_at=100.0)
    assert counts(tiresias(ClusterSnapshot(devices(2), (veteran, newcomer)))) == {1: 0, 2: 2}
    too_big = gang(3, 4, submitted_at=0.5)
    fits = gang(4, 1, submitted_at=1.0)
    assert counts(tiresias(ClusterSnapshot(devices(3), (too_big, fits)))) == {3: 0, 4: 1}


def test_optimus_gives_more_devices_where_they_cut_more_remaining_time() -> None:
    long = gang(1, 1, remaining_work=1e6, batch_size=1024)
    short = gang(2, 1, remaining_work=1e2, submitted_at=0.5, batch_size=1024)
    given = counts(optimus(ClusterSnapshot(devices(8), (long, short))))
    assert given[1] > given[2] >= 1
    assert sum(given.values()) == 8


def test_optimus_keeps_the_batch_size() -> None:
    job = hybrid_job(1, remaining_work=1e5)
    plan = optimus(ClusterSnapshot(devices(8), (job,)))
    assert plan.batch_sizes[1] == job.batch_size


def test_registry_knows_every_policy_and_refuses_others() -> None:
    assert DEFAULT_POLICY == "bungee"
    assert set(POLICY_NAMES) == {"bungee", "saxena", "fair", "fifo", "tiresias", "optimus"}
    for name in POLICY_NAMES:
        assert callable(get_policy(name))
    with pytest.raises(UnknownPolicyError, match="unknown scheduling policy 'sjf'; known: bungee"):
        get_policy("sjf")
    chosen = get_policy("bungee", resize_cost_s=1.0)
    assert isinstance(chosen, GoodputPolicy) and chosen.config.resize_cost_s == 1.0
