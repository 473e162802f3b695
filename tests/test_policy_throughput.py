"""The step-time model, its online learner, and statistical efficiency."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from elastic.scheduling import GradientNoise, ThroughputLearner, ThroughputModel
from elastic.scheduling.throughput import StepObservation, fit_throughput

TRUE = ThroughputModel(0.02, 0.0008, 0.01, 0.002, 0.12, 0.004, 2.2)
SHAPES = [
    (w, n, b)
    for w in (1, 2, 4, 8, 16)
    for n in {1, max(1, w // 4), max(1, w // 2)}
    for b in (16, 64, 256)
    if n <= w
]


def test_one_worker_is_pure_compute_and_accumulation_adds_compute() -> None:
    assert TRUE.step_time(1, 1, 100) == pytest.approx(0.02 + 0.08)
    assert TRUE.step_time(1, 1, 100, accumulation=3) == pytest.approx(3 * (0.02 + 0.08))


def test_crossing_nodes_costs_more_than_staying_on_one() -> None:
    assert TRUE.step_time(4, 2, 32) > TRUE.step_time(4, 1, 32)
    assert TRUE.samples_per_s(8, 2, 64) > TRUE.samples_per_s(1, 1, 64)


def test_overlap_is_between_sum_and_max() -> None:
    compute, sync = 0.02 + 0.0008 * 64, 0.12 + 0.004 * 6
    step = TRUE.step_time(8, 2, 64)
    assert max(compute, sync) < step < compute + sync


def test_invalid_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="invalid throughput parameters"):
        ThroughputModel(-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        ThroughputModel(0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5)


def test_learner_without_reports_returns_its_prior() -> None:
    prior = ThroughputModel.prior(0.2, 32)
    assert ThroughputLearner(prior).model() == prior


def test_learner_recovers_a_model_from_noisy_reports() -> None:
    rng = np.random.default_rng(0)
    learner = ThroughputLearner(ThroughputModel.prior(0.05, 16), prior_weight=0.01)
    for workers, nodes, batch in SHAPES:
        for _ in range(3):
            learner.observe(
                workers, nodes, batch, TRUE.step_time(workers, nodes, batch) * float(rng.lognormal(0, 0.03))
            )
    learned = learner.model()
    for workers, nodes, batch in [(2, 1, 32), (12, 3, 128), (32, 8, 64)]:
        assert learned.step_time(workers, nodes, batch) == pytest.approx(
            TRUE.step_time(workers, nodes, batch), rel=0.08
        )


def test_a_few_reports_move_the_prior_where_they_were_taken() -> None:
    learner = ThroughputLearner(ThroughputModel.prior(1.0, 32))
    for _ in range(5):
        learner.observe(1, 1, 32, 0.3)
    assert learner.model().step_time(1, 1, 32) == pytest.approx(0.3, rel=0.1)
    assert learner.observations == 5


def test_bad_observations_are_refused() -> None:
    learner = ThroughputLearner(TRUE)
    with pytest.raises(ValueError, match="step_time_s=0"):
        learner.observe(1, 1, 32, 0.0)
    with pytest.raises(ValueError):
        learner.observe(0, 1, 32, 1.0)


def test_fit_throughput_fits_a_trace_and_refuses_nothing() -> None:
    observed = [StepObservation(w, n, b, 1, TRUE.step_time(w, n, b)) for w, n, b in SHAPES]
    fitted = fit_throughput(observed)
    errors = [abs(fitted.step_time(o.workers, o.nodes, o.local_batch) / o.step_time_s - 1) for o in observed]
    assert max(errors) < 0.05
    with pytest.raises(ValueError, match="no step-time observations"):
        fit_throughput([])


@settings(max_examples=100, deadline=None)
@given(
    sqr=st.floats(0.0, 100.0),
    var=st.floats(0.0, 100.0),
    base=st.integers(1, 256),
    factor=st.floats(1.0, 512.0),
)
# A subnormal variance with no gradient: V / scale underflowed to 0 and the gain was infinite.
@example(sqr=0.0, var=5e-324, base=1, factor=2.0)
def test_gain_is_between_one_and_linear(sqr: float, var: float, base: int, factor: float) -> None:
    noise = GradientNoise(base, sqr, var)
    batch = base * factor
    assert float(noise.gain(base)) == pytest.approx(1.0)
    gain = float(noise.gain(batch))
    assert 1.0 - 1e-9 <= gain <= factor + 1e-9
    assert 0.0 < float(noise.efficiency(batch)) <= 1.0 + 1e-9


def test_noisy_gradients_make_large_batches_worth_more() -> None:
    quiet, noisy = GradientNoise(32, 10.0, 1.0), GradientNoise(32, 1.0, 100.0)
    assert float(noisy.gain(1024)) > float(quiet.gain(1024))
    with pytest.raises(ValueError, match="invalid gradient statistics"):
        GradientNoise(0, 1.0, 1.0)
