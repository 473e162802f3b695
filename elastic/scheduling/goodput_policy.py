"""The optimiser-driven policies: `bungee` (the default) and `saxena` (the plain idea).

Both run the dynamic program of `dynamic_program` over each job's speedup curve from `speedup`
(progress per second on k workers, at the best batch size for hybrid jobs, over the job's own
progress per second on one worker), so that the sum is the cluster's useful work counted in
single-device equivalents. `saxena` maximises exactly that, and nothing else.

`bungee` maximises the sum over jobs of  w_j * log(1 + S_j(k_j)), with the penalty below:

- spread: the logarithm (alpha-fairness with alpha = `spread` = 1) makes a job's first devices
  worth more than its last ones, so devices go round before any job takes a large share at a
  poor efficiency;
- priority by expected remaining work: w_j = 1 / (1 + R_j / scale), R_j the device-seconds the
  job still needs on one device. A job with an epoch budget knows its remaining work; a job that
  does not say stands in its attained service (least attained service, as Tiresias: under
  heavy-tailed job sizes the longer a job has run, the longer it will probably run on). Short
  jobs finish first, long ones still grow onto devices nobody else can use;
- a resize penalty: any count other than the job's current one is worth (1 - resize_cost /
  horizon) of its value, the share of the next `horizon` seconds the pause takes, so moves that
  gain less than a pause costs are not made and the cluster does not thrash; with a cheap resize
  (ours, about a second) the policy moves freely;
- stragglers: a worker slower than its peers by `threshold` in each of the last `window` steps is
  replaced by a free device, or, for a strict job with no device free, given fewer virtual
  workers (see `stragglers`).

Both share the frame of `allocation` (owner reclaim, guaranteed before opportunistic, pins,
placement with locality) and price locality in the curve (k workers on ceil(k / node size)
nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic.scheduling.allocation import Decision, Stage, allocate
from elastic.scheduling.api import ClusterSnapshot, JobView, Plan, Reason
from elastic.scheduling.dynamic_program import maximise
from elastic.scheduling.placement import FreeDevices
from elastic.scheduling.speedup import speedup_table, worker_grid
from elastic.scheduling.stragglers import StragglerConfig, handle_stragglers
from elastic.wording import counted

_STAY_BONUS = 1e-9
"""Relative bonus for a job's current count: among equal plans, the one that moves nothing."""


@dataclass(frozen=True)
class GoodputConfig:
    adapt_batch: bool = True
    """Choose the global batch size of hybrid jobs (otherwise keep their current one)."""
    fairness: bool = True
    """Weight each job by its expected remaining work (see GoodputPolicy.weights)."""
    remaining_scale_s: float = 3600.0
    """Device-seconds of expected remaining work at which a job's weight halves."""
    service_scale_s: float = 57600.0
    """The same for attained service, which stands in for jobs that give no estimate."""
    remaining_power: float = 1.0
    use_remaining_work: bool = True
    """Use the jobs' own estimates of the work they have left, where they give one."""
    spread: float = 1.0
    """Alpha-fairness of the speedup utility: 0 sums speedups (useful work); larger values
    value a job's first devices more than its last ones, spreading devices over more jobs."""
    resize_cost_s: float = 0.0
    """What one resize costs a job, in seconds of its progress."""
    horizon_s: float = 300.0
    """The stretch of a job's future a resize pause is weighed against."""
    stragglers: StragglerConfig | None = None


class GoodputPolicy:
    """A policy (see the module docstring): call it with a snapshot, get a plan."""

    def __init__(self, config: GoodputConfig) -> None:
        self.config = config

    def __call__(self, snapshot: ClusterSnapshot) -> Plan:
        hook = self._handle_stragglers if self.config.stragglers is not None else None
        return allocate(snapshot, self._counts, hook)

    def _handle_stragglers(
        self, snapshot: ClusterSnapshot, plan: Plan, spare: dict[int, FreeDevices]
    ) -> None:
        assert self.config.stragglers is not None
        handle_stragglers(snapshot, plan, spare, self.config.stragglers)

    def weights(self, jobs: Sequence[JobView], single_rate: np.ndarray) -> np.ndarray:
        """(1 + R) ** -remaining_power per job, R its expected remaining device-seconds over
        `remaining_scale_s` (its work left over its single-device rate) where it says how much
        work is left, else its attained device-seconds over `service_scale_s` (job sizes are
        heavy-tailed: the longer a job has run, the longer it is likely to run on, which is
        least attained service)."""
        if not self.config.fairness:
            return np.ones(len(jobs))
        scaled = np.array([max(j.attained_service_s, 0.0) / self.config.service_scale_s for j in jobs])
        if self.config.use_remaining_work:
            for j, job in enumerate(jobs):
                if job.remaining_work is not None and single_rate[j] > 0:
                    scaled[j] = max(job.remaining_work, 0.0) / single_rate[j] / self.config.remaining_scale_s
        return (1.0 + scaled) ** -self.config.remaining_power

    def utility(self, speedup: np.ndarray) -> np.ndarray:
        alpha = self.config.spread
        if alpha == 0:
            return speedup
        with np.errstate(invalid="ignore"):
            if alpha == 1:
                return np.where(np.isfinite(speedup), np.log1p(np.maximum(speedup, 0)), -np.inf)
            shaped = ((1.0 + np.maximum(speedup, 0)) ** (1.0 - alpha) - 1.0) / (1.0 - alpha)
            return np.where(np.isfinite(speedup), shaped, -np.inf)

    def _counts(self, jobs: Sequence[JobView], capacity: int, stage: Stage) -> Decision:
        largest = min(capacity, max(j.max_workers for j in jobs))
        grid = worker_grid(largest)
        table = speedup_table(jobs, grid, stage.node_size, self.config.adapt_batch)
        speedup = table.speedup()
        values = self.utility(speedup) * self.weights(jobs, table.single_rate)[:, None]
        available = {d.id for d in stage.snapshot.devices if d.available}
        penalty = (
            min(1.0, self.config.resize_cost_s / self.config.horizon_s) if self.config.horizon_s > 0 else 0.0
        )
        options, option_values = _options(jobs, grid, values, available, penalty)
        counts = maximise(options, option_values, capacity)
        spare = capacity - sum(counts)
        given = np.array(counts)
        column = np.searchsorted(grid, given)
        # The next candidate count above each job's: grid is sorted and holds every count given.
        above = grid[np.minimum(column + 1, len(grid) - 1)]
        limit = np.minimum(np.array([job.max_workers for job in jobs]), given + spare)
        grows = ((column + 1 < len(grid)) & (above <= limit)).tolist()
        batch = table.batch[np.arange(len(jobs)), column].tolist()
        decision = Decision({})
        for j, (job, count) in enumerate(zip(jobs, counts, strict=True)):
            decision.counts[job.id] = count
            if count == 0:
                continue
            if job.consistency == "hybrid" and job.batch_size is not None:
                chosen = int(batch[j]) or job.batch_size
                if chosen:
                    decision.batch_sizes[job.id] = chosen
            if grows[j]:
                decision.reasons[job.id] = Reason.NOT_WORTH
                decision.notes[job.id] = self._not_worth(
                    job, speedup[j], grid, count, int(above[j]), spare, penalty
                )
            elif count == job.min_workers:
                decision.reasons[job.id] = Reason.MINIMUM
            else:
                decision.reasons[job.id] = Reason.FAIR_SHARE if self.config.fairness else Reason.THROUGHPUT
        return decision

    def _not_worth(
        self, job: JobView, speedup: np.ndarray, grid: np.ndarray, count: int, more: int, spare: int, penalty: float
    ) -> str:
        """Why `job` stays on `count` workers with `spare` devices free, in the numbers the
        optimiser used: its modelled speedup there and on `more` workers, and the resize cost."""
        now, then = float(speedup[np.searchsorted(grid, count)]), float(speedup[np.searchsorted(grid, more)])
        head = (f"{count} of up to {counted(job.max_workers, 'worker')} with {counted(spare, 'device')} "
                f"free: its modelled speed on {counted(more, 'worker')} is "
                f"{then:.2f}x one worker's, against {now:.2f}x on {count}")
        if then <= now:
            return f"{head}; more workers would not make it faster"
        valued_now, valued_then = (float(v) for v in self.utility(np.array([now, then])))
        worth = valued_then / valued_now - 1.0 if valued_now > 0 else float("inf")
        return (f"{head}: +{then / now - 1.0:.0%} speed, worth +{worth:.1%} in the policy's value of "
                f"speed (alpha-fair, alpha {self.config.spread:g}), not more than a resize costs "
                f"({penalty:.1%} of the next {self.config.horizon_s:.0f} s)")


def _options(
    jobs: Sequence[JobView], grid: np.ndarray, values: np.ndarray, available: set[int], penalty: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each job's options for the dynamic program: the allowed counts of `grid` (finite
    `values`) that are worth more than every smaller one, with their values. A job that holds
    only devices still available pays the resize `penalty` on every other count but 0 and gets
    the stay bonus on its own; the others move anyway. All jobs at once (a row each)."""
    allowed = np.isfinite(values)
    held = np.array([len(job.current) for job in jobs])[:, None]
    intact = np.array([all(d in available for d in job.current) for job in jobs])[:, None]
    shaped = values.copy()
    shaped[allowed & intact & (grid != held) & (grid > 0)] *= 1.0 - penalty
    shaped[allowed & intact & (grid == held)] *= 1.0 + _STAY_BONUS
    masked = np.where(allowed, shaped, -np.inf)
    best_below = np.maximum.accumulate(masked, axis=1)
    useful = masked > np.concatenate([np.full((len(jobs), 1), -np.inf), best_below[:, :-1]], axis=1)
    useful[np.arange(len(jobs)), np.argmax(allowed, axis=1)] = True
    rows, columns = np.nonzero(useful)
    ends = np.cumsum(np.count_nonzero(useful, axis=1))[:-1]
    return np.split(grid[columns], ends), np.split(shaped[rows, columns], ends)


BUNGEE = GoodputConfig(fairness=True, resize_cost_s=30.0, stragglers=StragglerConfig())
SAXENA = GoodputConfig(fairness=False, spread=0.0, resize_cost_s=0.0, stragglers=None)
