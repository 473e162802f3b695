"""The life of a warm standby (agent.standby.StandbyState): the pool's one place that moves a
standby (StandbyPool._move) makes every listed transition and refuses every other one, leaving
the standby as it was; the final states have no way out, and the enum's docstring lists every
transition."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.devices import WorkerPlacement
from agent.standby import (
    STANDBY_TRANSITIONS,
    InvalidStandbyTransition,
    Standby,
    StandbyPool,
    StandbyState,
    check_standby_transition,
)

ALLOWED = {(s, t) for s, targets in STANDBY_TRANSITIONS.items() for t in targets}
ALL_PAIRS = set(itertools.product(StandbyState, StandbyState))
FINAL = {StandbyState.TAKEN, StandbyState.KILLED, StandbyState.DIED}
PAIRS = sorted(ALL_PAIRS)


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s.value}->{t.value}" for s, t in PAIRS])
def test_the_pool_makes_a_listed_transition_and_refuses_any_other(source: StandbyState, target: StandbyState) -> None:
    process = SimpleNamespace(pid=os.getpid())  # what the pool's log reads of it
    standby = Standby(0, WorkerPlacement(device="cpu"), process, Path("standby.out"), state=source)  # type: ignore[arg-type]
    since = standby.since
    if (source, target) in ALLOWED:
        StandbyPool._move(standby, target)
        assert standby.state is target and standby.since >= since
    else:
        with pytest.raises(InvalidStandbyTransition, match=f"from '{source.value}' to '{target.value}'"):
            StandbyPool._move(standby, target)
        assert (standby.state, standby.since) == (source, since)


@pytest.mark.parametrize("source,target", sorted(ALL_PAIRS - ALLOWED))
def test_unlisted_transition_is_refused(source: StandbyState, target: StandbyState) -> None:
    with pytest.raises(InvalidStandbyTransition, match=f"from '{source.value}' to '{target.value}'"):
        check_standby_transition(source, target)


def test_every_state_has_its_transitions_listed() -> None:
    assert set(STANDBY_TRANSITIONS) == set(StandbyState)


def test_the_final_states_have_no_way_out() -> None:
    assert {state for state in StandbyState if state.final} == FINAL


def test_every_state_but_the_final_ones_can_be_killed_or_die() -> None:
    """An owner's return kills a standby whatever it is doing, and any process can die."""
    for state in set(StandbyState) - FINAL:
        assert {StandbyState.KILLED, StandbyState.DIED} <= STANDBY_TRANSITIONS[state], state


def test_only_a_standby_sent_a_preparation_is_prepared() -> None:
    into_prepared = {s for s, t in ALLOWED if t in (StandbyState.PREPARED, StandbyState.BUILD_FAILED)}
    assert into_prepared == {StandbyState.PREPARING}


def test_an_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError, match="'asleep'"):
        check_standby_transition("warm", "asleep")


def test_the_docstring_lists_every_transition() -> None:
    doc = StandbyState.__doc__ or ""
    for source, target in ALLOWED:
        assert f"{source.value:<10} -> {target.value}" in doc, (source, target)
