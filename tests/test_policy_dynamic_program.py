"""The dynamic program finds the best counts (checked against brute force) and respects
capacity and each job's options."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.scheduling.dynamic_program import maximise

job_options = st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True).map(
    lambda ks: [0, *sorted(ks)]
)


@settings(max_examples=150, deadline=None)
@given(
    jobs=st.lists(st.tuples(job_options, st.lists(st.floats(0.0, 10.0), min_size=5, max_size=5)), max_size=4),
    capacity=st.integers(0, 12),
)
def test_matches_brute_force(jobs: list[tuple[list[int], list[float]]], capacity: int) -> None:
    options = [np.array(ks) for ks, _ in jobs]
    values = [np.array([0.0, *vs[: len(ks) - 1]]) for ks, vs in jobs]
    counts = maximise(options, values, capacity)
    assert sum(counts) <= capacity
    assert all(c in ks for c, ks in zip(counts, options, strict=True))
    best = max(
        (
            sum(float(v[list(k).index(c)]) for c, k, v in zip(choice, options, values, strict=True))
            for choice in itertools.product(*options)
            if sum(choice) <= capacity
        ),
        default=0.0,
    )
    got = sum(float(v[list(k).index(c)]) for c, k, v in zip(counts, options, values, strict=True))
    assert got == pytest.approx(best)


def test_a_job_is_given_its_minimum_or_nothing() -> None:
    options = [np.array([0, 3, 4]), np.array([0, 1, 2])]
    values = [np.array([0.0, 10.0, 11.0]), np.array([0.0, 4.0, 5.0])]
    assert maximise(options, values, 4) == [3, 1]
    assert maximise(options, values, 2) == [0, 2]


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        maximise([np.array([0])], [np.array([0.0])], -1)


def reference_maximise(options: list[np.ndarray], values: list[np.ndarray], capacity: int) -> list[int]:
    """The dynamic program as first written: the whole (budget x option) table of every job, the
    first best option of each row kept. The fast one must agree with it exactly, ties included."""
    best = np.zeros(capacity + 1)
    budget = np.arange(capacity + 1)
    reach = 0
    choices: list[np.ndarray] = []
    for ks, vs in zip(options, values, strict=True):
        reach = min(capacity, reach + int(ks.max()))
        before = budget[: reach + 1, None] - ks[None, :]
        candidate = np.where(before >= 0, best[np.maximum(before, 0)] + vs[None, :], -np.inf)
        pick = np.argmax(candidate, axis=1)
        best = best.copy()
        best[: reach + 1] = candidate[np.arange(reach + 1), pick]
        best[reach + 1 :] = best[reach]
        chosen = np.full(capacity + 1, pick[reach])
        chosen[: reach + 1] = pick
        choices.append(chosen)
    counts = [0] * len(options)
    left = capacity
    for j in range(len(options) - 1, -1, -1):
        counts[j] = int(options[j][choices[j][left]])
        left -= counts[j]
    return counts


unordered_options = st.lists(st.integers(1, 9), max_size=6, unique=True).flatmap(
    lambda ks: st.permutations([0, *ks])
)


@settings(max_examples=300, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(unordered_options, st.lists(st.integers(0, 4), min_size=7, max_size=7), st.booleans()),
        max_size=8,
    ),
    capacity=st.integers(0, 30),
)
def test_agrees_with_the_reference_ties_included(
    jobs: list[tuple[list[int], list[int], bool]], capacity: int
) -> None:
    """Small integer values make ties common; options come in any order, 0 anywhere."""
    options = [np.array(ks) for ks, _, _ in jobs]
    values = [
        np.array([float(v) if fine else float(v) / 3.0 for v in vs[: len(ks)]]) for ks, vs, fine in jobs
    ]
    assert maximise(options, values, capacity) == reference_maximise(options, values, capacity)
