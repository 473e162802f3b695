"""Straggler detection and replacement: migrate to a free device, or in strict mode give the slow
worker fewer virtual workers; a job with a slow device gets its throughput back."""

from __future__ import annotations

from dataclasses import replace

from elastic.scheduling import ClusterSnapshot, JobView, Reason, get_policy
from elastic.scheduling.stragglers import StragglerConfig, find_stragglers, virtual_worker_shares
from tests.policy_cases import devices, hybrid_job

bungee = get_policy("bungee")
CONFIG = StragglerConfig()


def timed(job: JobView, slow_rank: int | None, steps: int = 20, factor: float = 1.5) -> JobView:
    times = tuple(
        tuple(0.1 * (factor if rank == slow_rank else 1.0) * (1 + 0.01 * (step % 3)) for step in range(steps))
        for rank in range(len(job.current))
    )
    return replace(job, worker_step_times=times)


def test_a_worker_slow_for_the_whole_window_is_a_straggler() -> None:
    job = hybrid_job(1, current=(0, 1, 2, 3))
    found = find_stragglers(timed(job, 2), CONFIG)
    assert [s.rank for s in found] == [2]
    assert 1.4 < found[0].slowdown < 1.6


def test_short_or_mild_or_intermittent_slowness_is_not() -> None:
    job = hybrid_job(1, current=(0, 1, 2, 3))
    assert find_stragglers(timed(job, 2, steps=19), CONFIG) == []
    assert find_stragglers(timed(job, 2, factor=1.2), CONFIG) == []
    times = [list(t) for t in timed(job, 2).worker_step_times]
    times[2][7] = 0.1
    assert find_stragglers(replace(job, worker_step_times=tuple(map(tuple, times))), CONFIG) == []


def test_a_straggler_migrates_to_a_free_device_on_the_same_node() -> None:
    job = timed(hybrid_job(1, min_workers=3, max_workers=3, current=(0, 1, 2)), 1)
    plan = bungee(ClusterSnapshot(devices(8), (job,)))
    assert plan.assignments[1] == (0, 3, 2), "rank 1 moves to the free device beside its peers"
    action = plan.stragglers[0]
    assert (action.job_id, action.slow_device, action.replacement) == (1, 1, 3)
    assert Reason.STRAGGLER_REPLACED in plan.reasons[1]


def test_strict_job_with_no_free_device_gives_the_straggler_fewer_virtual_workers() -> None:
    job = hybrid_job(
        1, min_workers=4, max_workers=4, current=(0, 1, 2, 3), consistency="strict", virtual_workers=8
    )
    plan = bungee(ClusterSnapshot(devices(4), (timed(job, 3, factor=2.0),)))
    assert plan.assignments[1] == (0, 1, 2, 3)
    (action,) = plan.stragglers
    assert action.replacement is None
    assert action.virtual_workers == (3, 2, 2, 1)
    assert Reason.STRAGGLER_UNLOADED in plan.reasons[1]


def test_virtual_worker_shares_cover_every_rank() -> None:
    assert virtual_worker_shares(8, [1.0, 1.0, 1.0, 1.0]) == (2, 2, 2, 2)
    assert sum(virtual_worker_shares(16, [1.0, 3.0, 1.0])) == 16
    assert min(virtual_worker_shares(3, [1.0, 9.0, 1.0])) == 1


def test_throughput_recovers_after_the_straggler_is_replaced() -> None:
    """A toy cluster loop: device 1 runs at half speed; a synchronous step waits for it."""
    speed = {d.id: 0.5 if d.id == 1 else 1.0 for d in devices(8)}
    job = hybrid_job(1, min_workers=4, max_workers=4, current=(0, 1, 2, 3))
    history: list[tuple[float, ...]] = [() for _ in job.current]
    throughput = []
    for _cycle in range(4):
        step = max(0.1 / speed[d] for d in job.current)
        throughput.append(1.0 / step)
        per_worker = [0.1 / speed[d] for d in job.current]
        history = [(*h, *([t] * 10))[-CONFIG.window :] for h, t in zip(history, per_worker, strict=True)]
        job = replace(job, worker_step_times=tuple(history))
        plan = bungee(ClusterSnapshot(devices(8), (job,)))
        if plan.assignments[1] != job.current:
            history = [
                h if d in job.current and d == new else ()
                for h, d, new in zip(history, job.current, plan.assignments[1], strict=True)
            ]
            job = replace(job, current=plan.assignments[1], worker_step_times=())
    assert throughput[0] == throughput[1] == 5.0, "slowed by device 1 while the window fills"
    assert throughput[-1] == 10.0, "back to full speed after the migration"
    assert 1 not in job.current
