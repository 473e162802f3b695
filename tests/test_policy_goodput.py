"""The optimiser-driven policies: useful work, batch sizes, the resize penalty, fairness,
locality, opportunistic devices and the reasons the board shows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from elastic.scheduling import ClusterSnapshot, DeviceView, JobView, Plan, Reason, ThroughputModel, get_policy
from elastic.scheduling.goodput_policy import BUNGEE, GoodputPolicy
from elastic.scheduling.speedup import speedup_table, worker_grid
from tests.policy_cases import SCALES_BADLY, SCALES_WELL, counts, devices, hybrid_job

bungee = get_policy("bungee")
saxena = get_policy("saxena")


def test_devices_go_where_they_do_the_most_work() -> None:
    strict = dict(consistency="strict", gradient_noise=None, batch_size=256)
    snapshot = ClusterSnapshot(
        devices(8), (hybrid_job(1, SCALES_WELL, **strict), hybrid_job(2, SCALES_BADLY, **strict))
    )
    for policy in (bungee, saxena):
        given = counts(policy(snapshot))
        assert given[1] > given[2] >= 1


def test_hybrid_jobs_get_a_batch_within_bounds_that_grows_with_workers() -> None:
    small = ClusterSnapshot(devices(1), (hybrid_job(1),))
    large = ClusterSnapshot(devices(16), (hybrid_job(1),))
    few, many = bungee(small), bungee(large)
    assert len(many.assignments[1]) > 1
    assert 32 <= few.batch_sizes[1] <= many.batch_sizes[1] <= 1024


def test_strict_jobs_keep_their_batch_and_stay_within_virtual_workers() -> None:
    job = hybrid_job(1, consistency="strict", batch_size=64, virtual_workers=4)
    plan = bungee(ClusterSnapshot(devices(16), (job,)))
    assert 1 not in plan.batch_sizes
    assert len(plan.assignments[1]) <= 4


def _marginal_model() -> tuple[ThroughputModel, float]:
    """A model whose fourth worker adds a little (returns the model and S(4) / S(3))."""
    model = ThroughputModel(0.0, 0.002, 0.01, 0.02, 0.3, 0.01, 1.0)
    job = hybrid_job(1, model, consistency="strict", gradient_noise=None, batch_size=128)
    table = speedup_table([job], worker_grid(4), node_size=4)
    speedup = table.speedup()[0]
    return model, float(speedup[4] / speedup[3])


def test_a_resize_that_gains_less_than_it_costs_is_not_made() -> None:
    model, ratio = _marginal_model()
    assert 1.0 < ratio < 1.0 + BUNGEE.resize_cost_s / BUNGEE.horizon_s
    job = hybrid_job(1, model, consistency="strict", gradient_noise=None, batch_size=128, current=(0, 1, 2))
    snapshot = ClusterSnapshot(devices(4), (job,))
    assert counts(bungee(snapshot))[1] == 3, "the pause costs more than the fourth worker brings"
    assert counts(saxena(snapshot))[1] == 4, "without the penalty the fourth worker is worth taking"
    cheap = GoodputPolicy(replace(BUNGEE, resize_cost_s=1.0))
    assert counts(cheap(snapshot))[1] == 4, "a one-second resize is worth it"


def test_least_attained_service_wins_a_scarce_device() -> None:
    veteran = hybrid_job(1, current=(0,), attained_service_s=500_000.0)
    newcomer = hybrid_job(2)
    plan = bungee(ClusterSnapshot(devices(1), (veteran, newcomer)))
    assert counts(plan) == {1: 0, 2: 1}
    assert plan.reasons[1] == (Reason.WAITING,)
    assert counts(saxena(ClusterSnapshot(devices(1), (veteran, newcomer))))[1] == 1, "saxena ignores service"


def test_a_four_worker_job_lands_on_one_node() -> None:
    job = hybrid_job(1, min_workers=4, max_workers=4)
    other = hybrid_job(2, min_workers=2, max_workers=2, current=(0, 4))
    plan = bungee(ClusterSnapshot(devices(12), (job, other)))
    nodes = {d // 4 for d in plan.assignments[1]}
    assert len(nodes) == 1


def test_lent_devices_go_to_opportunistic_jobs_and_come_back_to_their_owner() -> None:
    cluster = (*devices(2), DeviceView(2, "n9", owner="alice"), DeviceView(3, "n9", owner="alice"))
    guaranteed = hybrid_job(1, max_workers=2, consistency="strict", gradient_noise=None)
    opportunistic = hybrid_job(
        2,
        max_workers=4,
        requested_workers=2,
        priority="opportunistic",
        consistency="strict",
        gradient_noise=None,
    )
    for name in ("bungee", "saxena", "fair", "tiresias", "optimus"):
        plan = get_policy(name)(ClusterSnapshot(cluster, (guaranteed, opportunistic)))
        assert set(plan.assignments[1]) <= {0, 1}, name
        assert set(plan.assignments[2]) & {2, 3}, name
        if name != "fair":
            assert Reason.BORROWED in plan.reasons[2], name
    held = replace(opportunistic, current=(2, 3))
    back = tuple(replace(d, owner_present=d.id == 2) for d in cluster)
    plan = bungee(ClusterSnapshot(back, (guaranteed, held)))
    assert 2 not in plan.assignments[2], "the owner's device is taken back at once"


def test_a_guaranteed_job_takes_shared_devices_back_from_an_opportunistic_one() -> None:
    opportunistic = hybrid_job(2, priority="opportunistic", current=(0, 1, 2, 3), max_workers=4)
    arriving = hybrid_job(1, min_workers=2, max_workers=2, submitted_at=50.0)
    plan = bungee(ClusterSnapshot(devices(4), (arriving, opportunistic)))
    assert len(plan.assignments[1]) == 2
    assert len(plan.assignments[2]) == 2
    assert set(plan.assignments[2]) < {0, 1, 2, 3}


def test_pins_and_reasons() -> None:
    pinned = hybrid_job(1, pinned_workers=3, max_workers=8)
    minimal = hybrid_job(2, min_workers=2, max_workers=2)
    waiting = hybrid_job(3, min_workers=4, max_workers=4)
    plan = bungee(ClusterSnapshot(devices(6), (pinned, minimal, waiting)))
    assert counts(plan) == {1: 3, 2: 2, 3: 0}
    assert plan.reasons == {1: (Reason.PINNED,), 2: (Reason.MINIMUM,), 3: (Reason.WAITING,)}
    too_big = replace(pinned, pinned_workers=8)
    plan = bungee(ClusterSnapshot(devices(6), (too_big,)))
    assert counts(plan) == {1: 6}
    assert plan.pin_problems[1] == "pinned to 8 workers but given 6: 6 devices free for it (min 1, max 8)"
    assert plan.reasons[1] == (Reason.PIN_UNMET,)


def test_speedup_is_one_on_one_worker_and_infeasible_outside_bounds() -> None:
    job = hybrid_job(1, min_workers=2, max_workers=5)
    table = speedup_table([job], worker_grid(8), node_size=4)
    speedup = table.speedup()[0]
    assert speedup[0] == 0.0
    assert np.isneginf(speedup[1]) and np.isneginf(speedup[6])
    assert np.all(np.isfinite(speedup[2:6]))
    assert table.single_rate[0] > 0


def test_free_devices_left_unused_are_explained_with_the_numbers() -> None:
    """A job left below its maximum while devices are free is not "at its minimum": the reason
    says the policy judged more workers not worth it, with the speedups and the resize cost it
    weighed. (After a crash the probe saw a job on 1 of 2 workers, 3 devices free, told "its
    minimum of 1 workers".)"""
    devices4 = tuple(DeviceView(i, "a") for i in range(4))

    def plan_for(model: ThroughputModel, resize_cost_s: float) -> Plan:
        job = JobView(1, 1, 4, current=(0,), batch_size=32, throughput=model, remaining_work=100.0)
        return get_policy("bungee", resize_cost_s=resize_cost_s)(ClusterSnapshot(devices4, (job,)))

    slower = plan_for(ThroughputModel(0.1, 0.0, 0.02, 0.02, 0.05, 0.01, 1.0), 1.0)
    assert slower.assignments[1] == (0,) and slower.reasons[1] == (Reason.NOT_WORTH,)
    assert slower.notes[1] == (
        "1 of up to 4 workers with 3 devices free: its modelled speed on 2 workers is 0.83x one worker's, "
        "against 1.00x on 1; more workers would not make it faster"
    )
    barely = ThroughputModel(0.1, 0.0004, 0.0, 0.0, 0.0, 0.0, 1.0)
    costly = plan_for(barely, 30.0)
    assert costly.assignments[1] == (0,) and costly.reasons[1] == (Reason.NOT_WORTH,)
    assert "1.06x one worker's" in costly.notes[1] and "+6% speed" in costly.notes[1]
    assert "not more than a resize costs (10.0% of the next 300 s)" in costly.notes[1]
    cheap = plan_for(barely, 1.0)
    assert cheap.assignments[1] == (0, 1, 2, 3) and cheap.reasons[1] == (Reason.FAIR_SHARE,) and not cheap.notes
