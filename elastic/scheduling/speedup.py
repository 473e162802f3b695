"""Every job's speedup curve at once: the rate of progress of each job on each candidate number
of workers, at the best batch size it may use there, as numpy arrays.

The rate is the goodput of `goodput`: base-batch steps per second, i.e. statistical gain over
step time. A strict job (or a hybrid one whose gradient noise is not known yet) has one batch
size; a hybrid job with known noise tries a geometric ladder between its bounds and keeps the
best. Workers on one node cost less to synchronise than workers across nodes, so k workers are
priced at the fewest nodes that can hold them (placement then tries to achieve that).

All jobs are evaluated in one vectorised pass (jobs x worker counts x batch sizes); the step
times, which depend on a job's curve and batch sizes but not on its gradient noise, once per
distinct curve and batch ladder (the jobs of one workload share them). At 1,000 jobs and
2,048 devices the table takes about 11 ms of CPU of a decision's 65.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from elastic.scheduling.api import JobView
from elastic.scheduling.throughput import ThroughputModel, step_times

LADDER_STEPS = 10
DENSE_WORKERS = 16
"""Every worker count up to this is a candidate; then whole nodes' worth (multiples of 4) up to
64, then a geometric ladder: fewer options keep the dynamic program fast at 2,048 devices."""

_LINEAR = ThroughputModel(0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0).as_array()
"""Step time proportional to the local batch, no synchronisation: perfect scaling."""


def worker_grid(largest: int) -> np.ndarray:
    """Candidate worker counts from 0 to `largest` (see DENSE_WORKERS), always with `largest`."""
    dense = np.arange(0, min(largest, DENSE_WORKERS) + 1)
    if largest <= DENSE_WORKERS:
        return dense
    nodes = np.arange(DENSE_WORKERS + 4, min(largest, 64) + 1, 4)
    ladder = np.round(np.geomspace(64, largest, 16)).astype(int) if largest > 64 else np.array([], dtype=int)
    return np.unique(np.concatenate([dense, nodes, ladder, [largest]]))


@dataclass(frozen=True)
class SpeedupTable:
    workers: np.ndarray
    """(K,) candidate worker counts; workers[0] == 0."""
    rate: np.ndarray
    """(J, K) progress per second at the best batch; 0 at 0 workers; -inf where not allowed."""
    batch: np.ndarray
    """(J, K) the global batch size achieving `rate` (0 where there is none)."""
    single_rate: np.ndarray
    """(J,) the rate on one worker at its best batch: the unit of each job's speedup."""

    def speedup(self) -> np.ndarray:
        """(J, K) rate over single-worker rate: 0 at 0 workers, -inf where not allowed."""
        with np.errstate(invalid="ignore"):
            return np.where(np.isfinite(self.rate), self.rate / self.single_rate[:, None], -np.inf)


def _batch_candidates(job: JobView, adapt_batch: bool) -> list[float]:
    if job.batch_size is None:
        return [math.nan]
    if (
        adapt_batch
        and job.consistency == "hybrid"
        and job.gradient_noise is not None
        and job.min_batch_size is not None
        and job.max_batch_size is not None
        and job.max_batch_size > job.min_batch_size
    ):
        return sorted({*_ladder(job.min_batch_size, job.max_batch_size), float(job.batch_size)})
    return [float(job.batch_size)]


@lru_cache(maxsize=1024)
def _ladder(smallest: int, largest: int) -> tuple[float, ...]:
    """The rounded geometric ladder of batch sizes between two bounds. Jobs of one workload
    share their bounds, and numpy's geomspace costs tens of microseconds a call: at 1,000 jobs
    it was a fifth of a decision."""
    return tuple(np.round(np.geomspace(smallest, largest, LADDER_STEPS)).tolist())


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the first index of each distinct row, the distinct row of each row): rows[kept][row_of]
    is `rows`, bit for bit."""
    seen: dict[bytes, int] = {}
    kept: list[int] = []
    row_of = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        key = row.tobytes()
        if key not in seen:
            seen[key] = len(kept)
            kept.append(i)
        row_of[i] = seen[key]
    return np.array(kept, dtype=np.int64), row_of


def speedup_table(
    jobs: Sequence[JobView], workers: np.ndarray, node_size: int, adapt_batch: bool = True
) -> SpeedupTable:
    """The table for `jobs` over the candidate worker counts `workers` (see SpeedupTable)."""
    n_jobs, n_workers = len(jobs), len(workers)
    candidates = [_batch_candidates(job, adapt_batch) for job in jobs]
    width = max((len(c) for c in candidates), default=1)
    batch = np.full((n_jobs, width), np.nan)
    for j, values in enumerate(candidates):
        batch[j, : len(values)] = values
    weak_scaling = np.isnan(batch[:, 0])
    curves: dict[int, np.ndarray] = {}  # by identity: the jobs of one workload share a model
    for job in jobs:
        if job.throughput is not None and id(job.throughput) not in curves:
            curves[id(job.throughput)] = job.throughput.as_array()
    params = np.array([_LINEAR if j.throughput is None else curves[id(j.throughput)] for j in jobs]).reshape(
        n_jobs, 7
    )
    max_local = np.array([j.max_local_batch_size or np.inf for j in jobs], dtype=float)
    base = np.array([j.gradient_noise.base_batch_size if j.gradient_noise else 1 for j in jobs], dtype=float)
    sqr = np.array([j.gradient_noise.grad_sqr if j.gradient_noise else 0.0 for j in jobs])
    var = np.array([j.gradient_noise.grad_var if j.gradient_noise else 0.0 for j in jobs])
    lo = np.array([j.min_workers for j in jobs])
    hi = np.array([min(j.max_workers, j.virtual_workers or j.max_workers) for j in jobs])

    # Step times depend on the curve, the batch sizes tried and the micro-batch limit alone, which
    # the jobs of one workload share: they are worked out once per distinct such row and handed
    # to every job that has it. Only the statistical gain is each job's own.
    shapes = np.concatenate([params, batch, max_local[:, None], weak_scaling[:, None]], axis=1)
    kept, shape_of = _distinct_rows(shapes)

    def rates(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        kk = np.maximum(k, 1).astype(float)[None, :, None]
        weak = weak_scaling[kept][:, None, None]
        global_batch = np.where(weak, kk, batch[kept][:, None, :])
        local = global_batch / kk
        accumulation = np.maximum(np.ceil(local / max_local[kept][:, None, None]), 1.0)
        micro = local / accumulation
        nodes = np.ceil(kk / node_size)
        with np.errstate(invalid="ignore", divide="ignore"):
            step = step_times(params[kept][:, None, None, :], kk, nodes, micro, accumulation)[shape_of]
            usable = (local >= 1.0)[shape_of]
            global_batch = global_batch[shape_of]
            scale = global_batch / base[:, None, None]
            total = (var + sqr)[:, None, None]
            rate = np.where(total > 0, total / (var[:, None, None] / scale + sqr[:, None, None]), 1.0)
            if weak_scaling.any():
                rate = np.where(weak_scaling[:, None, None], global_batch, rate)
            rate /= step
        usable &= np.isfinite(rate)
        rate[~usable] = -np.inf
        best = np.argmax(rate, axis=2)
        best_rate = np.take_along_axis(rate, best[..., None], axis=2)[..., 0]
        best_batch = np.nan_to_num(np.take_along_axis(global_batch, best[..., None], axis=2)[..., 0], nan=0.0)
        return best_rate, best_batch

    rate, best_batch = rates(workers) if n_jobs else (np.zeros((0, n_workers)), np.zeros((0, n_workers)))
    single, _ = rates(np.array([1])) if n_jobs else (np.zeros((0, 1)), None)
    allowed = (workers[None, :] >= lo[:, None]) & (workers[None, :] <= hi[:, None])
    rate = np.where(allowed, rate, -np.inf)
    rate[:, workers == 0] = 0.0
    single_rate = np.where(np.isfinite(single[:, 0]) & (single[:, 0] > 0), single[:, 0], 1.0)
    return SpeedupTable(workers, rate, np.where(np.isfinite(rate), best_batch, 0), single_rate)
