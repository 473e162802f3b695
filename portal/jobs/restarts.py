"""A job's restart budget: how many worker failures in a row it survives before it is failed.

A long job on a cluster whose machines fail meets a failure now and then, and each costs it a
second or two (the survivors go on from the last step). Counting failures over the job's whole
life failed such a job at its fourth, however far apart they were. The budget counts only the
failures of a bad stretch instead: a failure counts while it is at most `window_s` old, and a
stretch of healthy training (at least `healthy_s` since the previous failure, with steps
trained in it) clears the count. A job whose workers keep failing before it trains again (a
device that crashes whatever runs on it, a node that cannot start workers) spends its budget
within minutes. Failures of the job's own code are not counted here: they fail the job at once
(portal.jobs.lifecycle.worker_exited)."""

from __future__ import annotations

from dataclasses import dataclass

Failure = tuple[float, int]
"""When a worker failed (Unix time) and the job's steps done then."""


@dataclass(frozen=True)
class RestartBudget:
    limit: int
    """Failures in a stretch that are restarted; one more fails the job."""
    window_s: float
    """A failure older than this no longer counts."""
    healthy_s: float
    """Training this long since the previous failure, with steps done, clears the count."""

    def charge(self, counted: list[Failure], at: float, steps_done: int) -> list[Failure]:
        """The failures that count once one more happens at `at` with `steps_done` steps done:
        `counted` less those older than the window, none of them if the job trained healthily
        since the newest, and the new one last."""
        kept = [(when, steps) for when, steps in counted if at - when <= self.window_s]
        if kept:
            newest_at, newest_steps = kept[-1]
            if at - newest_at >= self.healthy_s and steps_done > newest_steps:
                kept = []
        return [*kept, (at, steps_done)]

    def spent(self, counted: list[Failure]) -> bool:
        """Whether the job has failed more often in its stretch than it may be restarted."""
        return len(counted) > self.limit

    def describe(self, counted: list[Failure]) -> str:
        """Why a job whose budget is spent was given up, for its message."""
        span = counted[-1][0] - counted[0][0] if counted else 0.0
        return (
            f"gave up after {len(counted)} worker failures in {span:.0f} s with under {self.healthy_s:.0f} s of "
            f"training between them (BUNGEE_MAX_RESTARTS={self.limit}, BUNGEE_RESTART_WINDOW_S="
            f"{self.window_s:.0f}, BUNGEE_RESTART_HEALTHY_S={self.healthy_s:.0f})"
        )
