"""The step clock's pace on a simulated node: after each step the worker sleeps (pace - 1) times
the CPU time the step took, never for time it spent waiting, and never more than
MAX_PACE_SLEEP_S at once."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.worker import step_clock
from elastic.worker.step_clock import MAX_PACE_SLEEP_S, StepClock


class Clocks:
    """Stands in for the module's `time`: the test moves the CPU and wall clocks and records the
    sleeps asked for."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.slept: list[float] = []

    def process_time(self) -> float:
        return self.cpu

    def perf_counter(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.wall

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds


class NoEvents:
    def emit(self, *args: Any, **fields: Any) -> None:
        pass


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    fake = Clocks()
    monkeypatch.setattr(step_clock, "time", fake)
    return fake


def step(clock: StepClock, clocks: Clocks, cpu_s: float, waited_s: float = 0.0) -> None:
    clock.start()
    clocks.cpu += cpu_s
    clocks.wall += cpu_s + waited_s
    clock.step_done()


def test_a_paced_step_sleeps_for_its_cpu_time_times_the_pace_less_one(clocks: Clocks) -> None:
    clock = StepClock(NoEvents(), every_s=3600.0, pace=5.0)  # type: ignore[arg-type]
    step(clock, clocks, cpu_s=0.010)
    step(clock, clocks, cpu_s=0.002, waited_s=2.0)  # a step that waited on a peer: little CPU
    assert clocks.slept == pytest.approx([0.040, 0.008])


def test_a_heavy_step_sleeps_at_most_the_cap(clocks: Clocks) -> None:
    clock = StepClock(NoEvents(), every_s=3600.0, pace=10.0)  # type: ignore[arg-type]
    step(clock, clocks, cpu_s=0.5)
    assert clocks.slept == [MAX_PACE_SLEEP_S]


def test_without_a_pace_a_step_never_sleeps(clocks: Clocks) -> None:
    clock = StepClock(NoEvents(), every_s=3600.0)  # type: ignore[arg-type]
    step(clock, clocks, cpu_s=0.5)
    assert clocks.slept == []


def test_a_slowdown_stretches_the_compute_before_the_all_reduce(clocks: Clocks) -> None:
    clock = StepClock(NoEvents(), every_s=3600.0, slowdown=3.0)  # type: ignore[arg-type]
    clock.start()
    clocks.wall += 0.010
    clock.compute_done()
    assert clocks.slept == pytest.approx([0.020])


def test_with_a_pace_a_slowdown_stretches_the_compute_in_the_devices_time(clocks: Clocks) -> None:
    clock = StepClock(NoEvents(), every_s=3600.0, slowdown=3.0, pace=4.0)  # type: ignore[arg-type]
    clock.start()
    clocks.wall += 0.010
    clock.compute_done()
    assert clocks.slept == pytest.approx([0.080])
