"""Each rank's own pace: the compute time of its steps, from a step's start to the moment it
enters the step's all-reduce. The wall time of a step is the same on every rank (they all wait
for the slowest in the all-reduce), so only this part tells a straggler from its peers. Every
rank reports its latest times as "step_times" events; the portal finds stragglers from them
(elastic.scheduling.stragglers).

On a simulated device that plays a slow one, the clock also stretches the compute by the
device's factor, sleeping before the all-reduce, so that the rank looks and is slow (with a pace,
the compute is stretched in the device's time: slowdown x pace). On a
simulated node with a pace, it paces the whole step: after each, the worker sleeps (pace - 1)
times the CPU time the step took (all of the process's threads), so that it keeps at most 1/pace
of a core busy. CPU time, not wall time: a step that waited (for a peer in its all-reduce, for a
joiner) cost little CPU and is not stretched into a long sleep."""

from __future__ import annotations

import time
from collections import deque

from elastic.worker.events import EventWriter

WINDOW = 20
"""Steps kept and reported: the straggler window of elastic.scheduling.stragglers."""
MAX_PACE_SLEEP_S = 1.0
"""The longest sleep a pace adds after one step: a rare heavy step (a checkpoint's save) does not
keep the worker from a stop or a switch for longer."""


class StepClock:
    def __init__(self, events: EventWriter, every_s: float, slowdown: float = 1.0, pace: float = 1.0) -> None:
        self._events = events
        self._every_s = every_s
        self._slowdown = slowdown
        self._pace = pace
        self._cpu_began = time.process_time()
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._began = time.perf_counter()
        self._reported_at = time.monotonic()

    def start(self) -> None:
        """A step begins."""
        self._began = time.perf_counter()
        if self._pace > 1.0:  # read only where a pace needs it: this is every step's path
            self._cpu_began = time.process_time()

    def compute_done(self) -> None:
        """The rank's share of the step is computed (its collectives come next): records the
        compute time of the step up to here."""
        compute = time.perf_counter() - self._began
        if self._slowdown > 1.0:
            # In the simulated device's time, which a pace makes `pace` times the CPU's: the
            # stretch is the slowdown's share of a paced compute.
            time.sleep((self._slowdown - 1.0) * self._pace * compute)
        self._times.append(time.perf_counter() - self._began)

    def step_done(self) -> None:
        """The step is over and training goes on: with a pace, sleeps (pace - 1) times the CPU time it took, at most
        MAX_PACE_SLEEP_S."""
        if self._pace > 1.0:
            time.sleep(min(MAX_PACE_SLEEP_S, (self._pace - 1.0) * (time.process_time() - self._cpu_began)))

    def report(self, generation_changed: bool = False) -> None:
        """Emits the latest times if due; a new generation starts a new window."""
        if generation_changed:
            self._times.clear()
            return
        now = time.monotonic()
        if now - self._reported_at < self._every_s or not self._times:
            return
        self._reported_at = now
        self._events.emit("step_times", step_times=[round(t, 6) for t in self._times])
