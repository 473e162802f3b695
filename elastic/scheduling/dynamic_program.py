"""The dynamic program at the heart of the default policy (Saxena et al.'s idea): given, for every
job, the value of giving it each allowed number of devices, find the counts that maximise the
sum of values within the devices there are.

best[g] is the most value the jobs seen so far can make of at most g devices; adding a job
tries each of its options k against best[g - k]. Options are the job's own allowed counts
(0 and min..max, thinned above 64), so a job that cannot run below its minimum is never given
fewer, which greedy marginal allocation cannot promise. Cost: jobs x (devices + 1) x options,
one numpy gather per job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def maximise(options: Sequence[np.ndarray], values: Sequence[np.ndarray], capacity: int) -> list[int]:
    """Counts (one per job, each from its `options`) with the largest total value using at most
    `capacity` devices. `options[j]` must contain 0; `values[j]` is aligned with it and finite.
    Ties go to the first option listed, so the answer is a function of the input alone."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity!r}")
    n_jobs = len(options)
    if n_jobs == 0:
        return []
    best = np.zeros(capacity + 1)
    budget = np.arange(capacity + 1)
    reach = 0
    choices: list[np.ndarray] = []
    for ks, vs in zip(options, values, strict=True):
        ks = np.asarray(ks, dtype=np.int64)
        reach = min(capacity, reach + int(ks.max()))
        span = budget[: reach + 1]
        before = span[:, None] - ks[None, :]
        candidate = np.where(before >= 0, best[np.maximum(before, 0)] + np.asarray(vs)[None, :], -np.inf)
        pick = np.argmax(candidate, axis=1)
        best = best.copy()
        best[: reach + 1] = candidate[np.arange(reach + 1), pick]
        if reach < capacity:
            best[reach + 1 :] = best[reach]
        chosen = np.zeros(capacity + 1, dtype=np.int64)
        chosen[: reach + 1] = pick
        chosen[reach + 1 :] = pick[reach]
        choices.append(chosen)
    counts = [0] * n_jobs
    left = capacity
    for j in range(n_jobs - 1, -1, -1):
        k = int(np.asarray(options[j])[choices[j][left]])
        counts[j] = k
        left -= k
    return counts
