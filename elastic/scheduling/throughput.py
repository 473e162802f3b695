"""How fast a job trains on a given number of workers: the step-time model behind every speedup
curve the scheduler uses, and the learner that fits it online from the workers' reports.

A step of data-parallel training is a forward-backward pass over the local batch (a fixed cost
plus a cost per sample) and an all-reduce of the gradients (nothing on one worker; a cost that
grows with the number of workers, higher once the workers span more than one node). The two
overlap partly, as back-propagation sends gradients while it still computes others; the overlap
exponent `overlap` blends them: 1 is no overlap (the sum), large is full overlap (the maximum).
A worker that cannot fit its share of the batch accumulates: it runs several micro-batches and
all-reduces once.

The learner keeps every distinct configuration it has seen with its mean step time and fits the
seven parameters by damped Gauss-Newton on the logarithm of step time, pulled towards a prior
(the generic one below, or one fitted from a trace), so that a job with two reports already has
a usable curve and a job with many has its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

PARAMETER_NAMES = (
    "compute_fixed_s",
    "compute_per_sample_s",
    "sync_local_s",
    "sync_local_per_worker_s",
    "sync_network_s",
    "sync_network_per_worker_s",
    "overlap",
)
_FLOOR = 1e-9


def step_times(
    params: np.ndarray,
    workers: np.ndarray | int,
    nodes: np.ndarray | int,
    local_batch: np.ndarray | float,
    accumulation: np.ndarray | int = 1,
) -> np.ndarray:
    """Step time (s) for stacked parameter vectors: `params` has the seven parameters on its last
    axis; the other arguments broadcast against `params[..., 0]`. `local_batch` is the size of one
    micro-batch; `accumulation` micro-batches make one step."""
    p = np.asarray(params, dtype=float)
    w = np.asarray(workers, dtype=float)
    n = np.asarray(nodes, dtype=float)
    b = np.asarray(local_batch, dtype=float)
    compute = p[..., 0] + p[..., 1] * b
    beyond_two = np.maximum(w - 2.0, 0.0)
    sync = np.where(n > 1, p[..., 4] + p[..., 5] * beyond_two, p[..., 2] + p[..., 3] * beyond_two)
    sync = np.where(w > 1, np.maximum(sync, _FLOOR), 0.0)
    gamma = p[..., 6]
    compute = np.maximum(compute, _FLOOR)
    larger = np.maximum(compute, sync)
    overlapped = larger * ((compute / larger) ** gamma + (sync / larger) ** gamma) ** (1.0 / gamma)
    return overlapped + (np.asarray(accumulation, dtype=float) - 1.0) * compute


@dataclass(frozen=True)
class ThroughputModel:
    """Seven non-negative parameters (see the module docstring); `overlap` is at least 1."""

    compute_fixed_s: float
    compute_per_sample_s: float
    sync_local_s: float
    sync_local_per_worker_s: float
    sync_network_s: float
    sync_network_per_worker_s: float
    overlap: float = 1.0

    def __post_init__(self) -> None:
        values = self.as_array()
        if not np.all(np.isfinite(values)) or np.any(values < 0) or self.overlap < 1:
            raise ValueError(
                f"invalid throughput parameters: {dict(zip(PARAMETER_NAMES, values, strict=True))}"
            )

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in PARAMETER_NAMES], dtype=float)

    @classmethod
    def from_array(cls, values: Iterable[float]) -> ThroughputModel:
        return cls(*(float(v) for v in values))

    @classmethod
    def prior(cls, single_worker_step_s: float = 0.1, local_batch: int = 32) -> ThroughputModel:
        """A generic curve for a job nobody has measured: compute dominated by the batch, an
        all-reduce worth a tenth of a step on one node and half a step across nodes, half
        hidden behind compute. Scaled to one measured (or guessed) single-worker step."""
        if single_worker_step_s <= 0 or local_batch <= 0:
            raise ValueError(
                f"a prior needs a positive step time and batch, got {single_worker_step_s!r} s at {local_batch!r}"
            )
        t = single_worker_step_s
        return cls(0.2 * t, 0.8 * t / local_batch, 0.1 * t, 0.01 * t, 0.5 * t, 0.01 * t, 2.0)

    def step_time(self, workers: int, nodes: int, local_batch: float, accumulation: int = 1) -> float:
        """Seconds per step of `workers` workers on `nodes` nodes, each on `local_batch` samples
        per micro-batch, `accumulation` micro-batches per step."""
        return float(step_times(self.as_array(), workers, nodes, local_batch, accumulation))

    def samples_per_s(self, workers: int, nodes: int, local_batch: float, accumulation: int = 1) -> float:
        step = self.step_time(workers, nodes, local_batch, accumulation)
        return workers * local_batch * accumulation / step


def _to_free(params: np.ndarray) -> np.ndarray:
    """Parameters to the unconstrained vector the fit moves: logarithms, overlap minus one."""
    shifted = params.copy()
    shifted[6] -= 1.0
    return np.log(np.maximum(shifted, _FLOOR))


def _from_free(free: np.ndarray) -> np.ndarray:
    params = np.exp(np.clip(free, -40.0, 10.0))
    params[6] += 1.0
    return params


@dataclass(frozen=True)
class StepObservation:
    workers: int
    nodes: int
    local_batch: float
    accumulation: int
    step_time_s: float


class ThroughputLearner:
    """Learns one job's ThroughputModel from observed step times, starting from a prior.

    `prior_weight` is how many observations the prior is worth per parameter (the spread of the
    Gaussian prior on each log-parameter is one over its square root): small lets a few reports
    move the curve, large keeps it near the prior.
    """

    def __init__(self, prior: ThroughputModel, prior_weight: float = 0.1, noise: float = 0.1) -> None:
        if prior_weight < 0 or noise <= 0:
            raise ValueError(f"prior_weight must be >= 0 and noise > 0, got {prior_weight!r}, {noise!r}")
        self._prior = prior
        self._prior_weight = prior_weight
        self._noise = noise
        self._sums: dict[tuple[int, int, float, int], tuple[float, int]] = {}
        self._model: ThroughputModel | None = prior

    @property
    def observations(self) -> int:
        return sum(count for _, count in self._sums.values())

    def observe(
        self, workers: int, nodes: int, local_batch: float, step_time_s: float, accumulation: int = 1
    ) -> None:
        """Adds one measured step. Raises ValueError for a non-positive time or shape."""
        if step_time_s <= 0 or workers < 1 or nodes < 1 or local_batch <= 0 or accumulation < 1:
            raise ValueError(
                f"bad observation: workers={workers!r} nodes={nodes!r} local_batch={local_batch!r} "
                f"accumulation={accumulation!r} step_time_s={step_time_s!r}"
            )
        key = (workers, nodes, float(local_batch), accumulation)
        log_sum, count = self._sums.get(key, (0.0, 0))
        self._sums[key] = (log_sum + math.log(step_time_s), count + 1)
        self._model = None

    def observe_many(self, observations: Iterable[StepObservation]) -> None:
        for o in observations:
            self.observe(o.workers, o.nodes, o.local_batch, o.step_time_s, o.accumulation)

    def model(self) -> ThroughputModel:
        """The maximum a posteriori model given everything observed (cached until the next
        observation)."""
        if self._model is None:
            self._model = ThroughputModel.from_array(self._fit())
        return self._model

    def _fit(self, iterations: int = 60) -> np.ndarray:
        keys = list(self._sums)
        workers = np.array([k[0] for k in keys], dtype=float)
        nodes = np.array([k[1] for k in keys], dtype=float)
        batch = np.array([k[2] for k in keys], dtype=float)
        accumulation = np.array([k[3] for k in keys], dtype=float)
        counts = np.array([self._sums[k][1] for k in keys], dtype=float)
        target = np.array([self._sums[k][0] for k in keys]) / counts
        data_scale = np.sqrt(counts) / self._noise
        prior_free = _to_free(self._prior.as_array())
        prior_scale = np.sqrt(self._prior_weight) / self._noise

        def residuals(free: np.ndarray) -> np.ndarray:
            predicted = step_times(_from_free(free), workers, nodes, batch, accumulation)
            fit = (np.log(np.maximum(predicted, _FLOOR)) - target) * data_scale
            return np.concatenate([fit, (free - prior_free) * prior_scale])

        free = prior_free.copy()
        current = residuals(free)
        cost = float(current @ current)
        damping = 1e-2
        for _ in range(iterations):
            jacobian = np.empty((current.size, free.size))
            for k in range(free.size):
                probe = free.copy()
                probe[k] += 1e-6
                jacobian[:, k] = (residuals(probe) - current) / 1e-6
            normal = jacobian.T @ jacobian
            gradient = jacobian.T @ current
            improved = False
            while damping < 1e9:
                step = np.linalg.solve(
                    normal + damping * (np.diag(np.diag(normal)) + 1e-9 * np.eye(free.size)), -gradient
                )
                trial = free + step
                trial_residuals = residuals(trial)
                trial_cost = float(trial_residuals @ trial_residuals)
                if trial_cost < cost:
                    free, current, cost = trial, trial_residuals, trial_cost
                    damping = max(damping / 3.0, 1e-9)
                    improved = True
                    break
                damping *= 4.0
            if not improved or float(np.max(np.abs(step))) < 1e-6:
                break
        return _from_free(free)


def fit_throughput(
    observations: Iterable[StepObservation], prior: ThroughputModel | None = None, prior_weight: float = 1e-4
) -> ThroughputModel:
    """Fits a model to many measurements (a trace) with only a faint pull towards `prior`.
    Raises ValueError when there is nothing to fit."""
    observed = list(observations)
    if not observed:
        raise ValueError("no step-time observations to fit")
    if prior is None:
        single = [o for o in observed if o.workers == 1] or observed
        reference = min(single, key=lambda o: o.local_batch)
        prior = ThroughputModel.prior(
            reference.step_time_s / reference.accumulation, int(max(1, reference.local_batch))
        )
    learner = ThroughputLearner(prior, prior_weight=prior_weight)
    learner.observe_many(observed)
    return learner.model()
