"""The pure parts of the two consistency modes: where strict mode's virtual workers go
(even or in proportion to throughput), hybrid mode's batch and learning-rate rules, and the spec
fields of each mode with their defaults and errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic.consistency.placement import check_shares, even_shares, hosted, proportional_shares
from elastic.spec import SpecError, validate_spec
from elastic.worker.hybrid import HybridSchedule, LrRamp

BASE = {"name": "m", "workload": "digits-cnn", "steps": 10, "min_workers": 1, "max_workers": 4}


def test_even_shares_and_what_each_rank_hosts() -> None:
    assert even_shares(8, 3) == [3, 3, 2]
    assert [list(hosted([3, 3, 2], rank)) for rank in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="rank"):
        hosted([3, 3, 2], 3)


def test_shares_follow_throughput_by_largest_remainder() -> None:
    assert proportional_shares(12, [3.0, 1.0, 2.0]) == [6, 2, 4]
    assert proportional_shares(8, [3.0, 1.0, 2.0]) == [4, 1, 3]  # quotas 4, 1.33, 2.67
    assert proportional_shares(4, [1.0, 1.0, 1.0, 100.0]) == [1, 1, 1, 1]  # one each at least
    assert proportional_shares(7, [1.0, 1.0, 1.0]) == [3, 2, 2]  # ties to the lower rank
    with pytest.raises(ValueError, match="cannot give each of 3 ranks one"):
        proportional_shares(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        proportional_shares(4, [1.0, 0.0])


@given(
    st.lists(st.floats(min_value=0.01, max_value=1000.0), min_size=1, max_size=12),
    st.integers(min_value=0, max_value=64),
)
def test_proportional_shares_place_every_virtual_worker_at_least_one_each(
    rates: list[float], extra: int
) -> None:
    virtual = len(rates) + extra
    shares = proportional_shares(virtual, rates)
    check_shares(shares, virtual, len(rates))
    assert min(shares) >= 1
    quotas = [virtual * rate / sum(rates) for rate in rates]
    # Largest remainder never strays more than one from a quota, except to give a rank its one.
    assert all(share <= max(1, math.ceil(quota)) + 1 for share, quota in zip(shares, quotas, strict=True))


def test_check_shares_rejects_a_placement_that_loses_a_virtual_worker() -> None:
    with pytest.raises(ValueError, match="do not place 4 virtual workers on 2 ranks"):
        check_shares([2, 1], 4, 2)


def test_hybrid_batch_follows_the_workers_within_bounds() -> None:
    schedule = HybridSchedule(0.1, 64, 16, 24, 48, "linear", 10)
    assert [schedule.global_batch(w) for w in (1, 2, 3, 4)] == [24, 32, 48, 48]
    assert schedule.target_lr(32) == pytest.approx(0.05)
    root = HybridSchedule(0.1, 64, 16, 16, 64, "sqrt", 10)
    assert root.target_lr(16) == pytest.approx(0.05) and root.target_lr(64) == pytest.approx(0.1)
    # The scheduler's choice wins over the per-worker rule, within the same bounds.
    assert [schedule.global_batch(2, chosen) for chosen in (40, 8, 96)] == [40, 24, 48]


def test_the_rate_ramps_linearly_and_then_holds() -> None:
    ramp = LrRamp(start_step=100, steps=4, from_lr=0.1, to_lr=0.2)
    assert [ramp.lr_at(step) for step in (99, 100, 101, 102, 103, 104)] == pytest.approx(
        [0.1, 0.125, 0.15, 0.175, 0.2, 0.2]
    )
    assert LrRamp(5, 0, 0.1, 0.3).lr_at(5) == 0.3


def test_strict_defaults_to_one_virtual_worker_per_worker_at_the_most() -> None:
    spec = validate_spec(BASE)
    assert spec.consistency == "strict" and spec.virtual_workers == 4
    assert spec.batch_per_worker is None and spec.min_batch_size is None


def test_hybrid_defaults_come_from_the_workload_batch() -> None:
    spec = validate_spec({**BASE, "consistency": "hybrid", "hyperparameters": {"batch_size": 64}})
    assert (spec.batch_per_worker, spec.min_batch_size, spec.max_batch_size) == (16, 16, 64)
    assert spec.lr_scaling == "linear" and spec.virtual_workers is None


def test_precision_is_fp32_by_default_and_bf16_for_either_mode() -> None:
    """Strict takes bf16 too: test_worker_strict_consistency shows it bit for bit through resizes."""
    assert validate_spec(BASE).precision == "fp32"
    assert validate_spec({**BASE, "consistency": "hybrid", "precision": "bf16"}).precision == "bf16"
    assert validate_spec({**BASE, "precision": "bf16"}).precision == "bf16"


@pytest.mark.parametrize(
    "change,field,fragment",
    [
        ({"virtual_workers": 3}, "virtual_workers", "must be at least max_workers (4)"),
        ({"virtual_workers": 65}, "virtual_workers", "at most the global batch size (64)"),
        ({"virtual_workers": 0}, "virtual_workers", "greater than or equal to 1"),
        ({"min_batch_size": 8}, "min_batch_size", "only hybrid jobs"),
        ({"consistency": "hybrid", "virtual_workers": 8}, "virtual_workers", "only strict jobs"),
        (
            {"consistency": "hybrid", "min_batch_size": 64, "max_batch_size": 32},
            "max_batch_size",
            "at least min_batch_size (64)",
        ),
        ({"consistency": "hybrid", "lr_scaling": "cubic"}, "lr_scaling", "'linear' or 'sqrt'"),
        ({"consistency": "hybrid", "warmup_steps": -1}, "warmup_steps", "greater than or equal to 0"),
        ({"precision": "fp16"}, "precision", "'fp32' or 'bf16'"),
        ({"consistency": "hybrid", "precision": "fp16"}, "precision", "'fp32' or 'bf16'"),
    ],
)
def test_bad_mode_fields_are_named(change: dict, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as raised:
        validate_spec({**BASE, **change})
    fields = {error.field: error for error in raised.value.errors}
    assert field in fields, raised.value.errors
    assert fragment in fields[field].message
    assert [error.field for error in raised.value.errors].count(field) == 1
