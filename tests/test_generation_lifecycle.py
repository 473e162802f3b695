"""The generation phases as portal.jobs.lifecycle writes them: every allowed transition moves
the row, every other one raises and leaves it as it was; a move made from a stale read (the
row moved meanwhile) changes nothing, so a report delivered twice cannot move it twice."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from elastic.membership import PHASE_TRANSITIONS, GenerationPhase, InvalidPhaseTransition
from portal.jobs import lifecycle
from portal.jobs.models import Generation, Job
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

PAIRS = list(itertools.product(GenerationPhase, repeat=2))


@pytest.fixture
def job(users: dict[str, Any]) -> Job:
    return Job.objects.create(
        owner=users["alice"], name="j", workload="digits-mlp", spec=VALID_SPEC, min_workers=1,
        max_workers=2, priority="guaranteed", consistency="strict", total_steps=50, generation=1,
    )


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_every_phase_transition(job: Job, source: GenerationPhase, target: GenerationPhase) -> None:
    row = Generation.objects.create(job=job, number=1, phase=source, reason="test")
    if target in PHASE_TRANSITIONS[source]:
        assert lifecycle.move_phase(row, target)
        row.refresh_from_db()
        assert row.phase == target
        assert (row.ended_at is not None) == target.final
    else:
        with pytest.raises(InvalidPhaseTransition, match=f"from '{source.value}' to '{target.value}'"):
            lifecycle.move_phase(row, target)
        row.refresh_from_db()
        assert row.phase == source


def test_a_stale_move_changes_nothing(job: Job) -> None:
    row = Generation.objects.create(job=job, number=1, phase=GenerationPhase.PUBLISHED, reason="test")
    stale = Generation.objects.get(pk=row.pk)
    assert lifecycle.move_phase(row, GenerationPhase.FORMED)
    assert not lifecycle.move_phase(stale, GenerationPhase.EXPIRED), "it formed meanwhile"
    row.refresh_from_db()
    assert row.phase == GenerationPhase.FORMED


def test_every_open_phase_has_a_way_out() -> None:
    """No phase but the final ones lacks a transition to a final phase: nothing waits for good."""
    for phase in GenerationPhase:
        if not phase.final:
            assert any(target.final for target in PHASE_TRANSITIONS[phase]), phase
