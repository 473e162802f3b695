"""The life of a worker process (agent.worker_process.WorkerState): the one place that moves a
worker (WorkerProcess._move) makes every listed transition and refuses every other one, leaving
the worker as it was; the methods that move a worker refuse to act from a state they may not
move it from; exited has no way out, and the enum's docstring lists every transition."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable

import pytest

from agent.worker_process import (
    WORKER_TRANSITIONS,
    InvalidWorkerTransition,
    WorkerProcess,
    WorkerState,
    check_worker_transition,
)

_W = WorkerState
ALLOWED = {(s, t) for s, targets in WORKER_TRANSITIONS.items() for t in targets}
PAIRS = sorted(itertools.product(WorkerState, WorkerState))


def worker_in(state: WorkerState) -> WorkerProcess:
    return WorkerProcess(
        job_id=1, generation=2, rank=0, device_index=0, stem="job1-gen2-rank0-test", state=state
    )


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s.value}->{t.value}" for s, t in PAIRS])
def test_a_worker_makes_a_listed_transition_and_refuses_any_other(
    source: WorkerState, target: WorkerState
) -> None:
    worker = worker_in(source)
    if (source, target) in ALLOWED:
        worker._move(target)
        assert worker.state is target
    else:
        with pytest.raises(InvalidWorkerTransition, match=f"from '{source.value}' to '{target.value}'"):
            worker._move(target)
        assert worker.state is source


def test_every_state_has_its_transitions_listed() -> None:
    assert set(WORKER_TRANSITIONS) == set(WorkerState)


def test_only_exited_is_final_and_every_running_state_can_end() -> None:
    assert {state for state in WorkerState if state.final} == {_W.EXITED}
    for state in WorkerState:
        assert (_W.ENDED in WORKER_TRANSITIONS[state]) == state.running, state


def test_the_docstring_lists_every_transition() -> None:
    doc = WorkerState.__doc__ or ""
    for source, target in ALLOWED:
        assert f"{source.value:<8} -> {target.value}" in doc, (source, target)


def test_an_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError, match="'asleep'"):
        check_worker_transition("warming", "asleep")


# --- the methods that perform the transitions refuse what the table does not list ------------


REFUSALS: list[tuple[str, WorkerState, Callable[[WorkerProcess], object]]] = [
    ("a joined line before it runs", _W.STARTING, lambda w: w.said_joined(3, 0)),
    ("a joined line after its exit is out", _W.EXITED, lambda w: w.said_joined(3, 0)),
    ("leaving before it runs", _W.STARTING, lambda w: w.expect_to_leave(60.0, "test")),
    ("leaving after its exit is out", _W.EXITED, lambda w: w.expect_to_leave(60.0, "test")),
    ("kept before it runs", _W.STARTING, lambda w: w.keep()),
    ("settled while it runs", _W.JOINED, lambda w: w.settle()),
    ("settled while it is asked to stop", _W.STOPPING, lambda w: w.settle()),
    ("settled before it runs", _W.STARTING, lambda w: w.settle()),
    ("settled twice", _W.EXITED, lambda w: w.settle()),
    ("ended before it runs", _W.STARTING, lambda w: w.ended()),
    ("ended twice", _W.ENDED, lambda w: w.ended()),
    ("failing to spawn once it runs", _W.WARMING, lambda w: w.spawn_failed()),
    ("failing to spawn a re-adopted worker", _W.ADOPTED, lambda w: w.spawn_failed()),
    ("failing to spawn once it ended", _W.ENDED, lambda w: w.spawn_failed()),
]


@pytest.mark.parametrize(("what", "state", "act"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_method_refuses_a_move_its_state_does_not_allow(
    what: str, state: WorkerState, act: Callable[[WorkerProcess], object]
) -> None:
    worker = worker_in(state)
    with pytest.raises(InvalidWorkerTransition):
        act(worker)
    assert worker.state is state, what


def test_a_spawned_worker_cannot_be_spawned_again() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        worker = worker_in(_W.STARTING)
        assert worker.spawned(process, None, None) is None
        assert (worker.state, worker.pid) == (_W.WARMING, process.pid)
        with pytest.raises(InvalidWorkerTransition, match="from 'warming' to 'warming'"):
            worker.spawned(process, None, None)
        assert worker.state is _W.WARMING
    finally:
        process.wait(timeout=60)


def test_a_stop_asked_of_a_starting_worker_is_handed_to_its_spawner() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        worker = worker_in(_W.STARTING)
        assert not worker.terminate("stop (cancel)", 5.0), "nothing to signal yet"
        assert worker.state is _W.STARTING
        assert worker.spawned(process, None, None) == "stop (cancel)"
    finally:
        process.wait(timeout=60)


def test_joined_lines_move_a_worker_only_out_of_warming_or_adopted() -> None:
    for state, after in [
        (_W.WARMING, _W.JOINED),
        (_W.ADOPTED, _W.JOINED),
        (_W.JOINED, _W.JOINED),
        (_W.LEAVING, _W.LEAVING),
        (_W.STOPPING, _W.STOPPING),
        (_W.ENDED, _W.ENDED),  # its last lines are read after its end
    ]:
        worker = worker_in(state)
        worker.said_joined(5, 3)
        assert (worker.state, worker.generation, worker.rank, worker.joined) == (after, 5, 3, True), state


def test_a_kept_leaver_goes_back_to_where_it_was() -> None:
    warming, joined = worker_in(_W.WARMING), worker_in(_W.WARMING)
    joined.said_joined(3, 0)
    for worker in (warming, joined):
        worker.expect_to_leave(600.0, "test")
        assert worker.state is _W.LEAVING
        worker.keep()
    assert (warming.state, joined.state) == (_W.WARMING, _W.JOINED)
