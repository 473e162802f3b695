"""The phases of a membership generation (elastic.membership.GenerationPhase): every pair of
phases the table does not list is refused, the final phases have no way out, and the module
docstring lists every transition. That the code which moves a generation (portal.jobs.lifecycle.
move_phase) makes each listed transition and refuses every other one is
tests/test_generation_lifecycle.py's."""

from __future__ import annotations

import itertools

import pytest

import elastic.membership.api as api
from elastic.membership import (
    PHASE_TRANSITIONS,
    GenerationPhase,
    InvalidPhaseTransition,
    check_phase_transition,
)

ALLOWED = {(s, t) for s, targets in PHASE_TRANSITIONS.items() for t in targets}
ALL_PAIRS = set(itertools.product(GenerationPhase, GenerationPhase))
FINAL = {GenerationPhase.LOST, GenerationPhase.EXPIRED, GenerationPhase.SUPERSEDED, GenerationPhase.ENDED}


@pytest.mark.parametrize("source,target", sorted(ALL_PAIRS - ALLOWED))
def test_unlisted_transition_is_refused(source: GenerationPhase, target: GenerationPhase) -> None:
    with pytest.raises(InvalidPhaseTransition, match=f"from '{source.value}' to '{target.value}'"):
        check_phase_transition(source, target)


def test_every_phase_has_its_transitions_listed() -> None:
    assert set(PHASE_TRANSITIONS) == set(GenerationPhase)


def test_the_final_phases_have_no_way_out() -> None:
    assert {phase for phase in GenerationPhase if phase.final} == FINAL
    for phase in FINAL:
        assert PHASE_TRANSITIONS[phase] == frozenset()


def test_a_lost_or_expired_generation_is_planned_again() -> None:
    assert {phase for phase in GenerationPhase if phase.needs_replan} == {
        GenerationPhase.LOST,
        GenerationPhase.EXPIRED,
    }
    assert {phase for phase in GenerationPhase if phase.in_flight} == {
        GenerationPhase.PLANNED,
        GenerationPhase.PUBLISHED,
    }


def test_an_unknown_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="'forming'"):
        check_phase_transition("planned", "forming")


def test_the_docstring_lists_every_transition() -> None:
    doc = api.__doc__ or ""
    for source, target in ALLOWED:
        assert f"{source.value:<10} -> {target.value}" in doc, (source, target)
