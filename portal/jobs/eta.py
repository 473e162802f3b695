"""When a running job should finish: the one estimate that the board, the job's page, the API and
the CLI show (Job.finish_estimate_at), made from a window over the job's progress rather than its
last report.

The step rate is exponentially weighted over time: a second of training `age` seconds ago counts
with weight exp(-age / RATE_WINDOW_S), so the rate is the decayed steps over the decayed seconds.
A resize's pause, a slow report or a burst moves it by its share of the window only: the last
report's throughput alone swung a job's estimate from 10 min to 1 h to 8 min within two minutes
(seen on the job page). The estimate is shown only once the window holds STABLE_AFTER_S of training. A gap
of more than GAP_S between two reports (workers report every half second) is not training time:
the job waited in the queue or its workers restarted; it is left out, and so is a report of a step
before the last one (a restart from a checkpoint)."""

from __future__ import annotations

import math
from dataclasses import dataclass

RATE_WINDOW_S = 120.0
"""The time constant of the step rate's window."""
STABLE_AFTER_S = 30.0
"""The (decayed) seconds of training the window must hold before an estimate is shown."""
GAP_S = 60.0
"""Reports further apart than this: the job was not training in between."""


@dataclass(frozen=True)
class StepRate:
    """A job's step rate so far: its decayed steps and decayed seconds of training."""

    steps: float = 0.0
    seconds: float = 0.0

    def after(self, steps: int, seconds: float) -> StepRate:
        """The rate once `steps` more steps trained in `seconds` more seconds; itself for a
        stretch that is no training (none, a step back, a gap over GAP_S)."""
        if not 0 < seconds <= GAP_S or steps < 0:
            return self
        kept = math.exp(-seconds / RATE_WINDOW_S)
        return StepRate(self.steps * kept + steps, self.seconds * kept + seconds)

    @property
    def steps_per_s(self) -> float | None:
        """Steps a second over the window, or None while it holds under STABLE_AFTER_S."""
        if self.seconds < STABLE_AFTER_S or self.steps <= 0:
            return None
        return self.steps / self.seconds


def finish_estimate_at(rate: StepRate, steps_left: int, reported_at: float) -> float | None:
    """When (Unix time) `steps_left` steps after the report at `reported_at` should be done at
    `rate`, to a tenth of a second; None while the rate is not stable."""
    steps_per_s = rate.steps_per_s
    if steps_per_s is None:
        return None
    return round(reported_at + max(steps_left, 0) / steps_per_s, 1)
