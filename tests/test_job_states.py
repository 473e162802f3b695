"""The job state machine: `Job.claim` (the one way a job's state changes) makes every listed
transition and refuses every other one, leaving the row as it was; a claim moves a job only
from the state its caller read."""

from __future__ import annotations

import itertools

import pytest

from portal.jobs.states import FINAL_STATES, TRANSITIONS, InvalidTransition, JobState, check_transition

ALLOWED = {(s, t) for s, targets in TRANSITIONS.items() for t in targets}
PAIRS = sorted(itertools.product(JobState, JobState))


@pytest.mark.django_db
@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s.value}->{t.value}" for s, t in PAIRS])
def test_claim_makes_a_listed_transition_and_refuses_any_other(source: JobState, target: JobState) -> None:
    from django.contrib.auth import get_user_model

    from portal.jobs.models import Job

    job = Job.objects.create(
        owner=get_user_model().objects.create(username="alice"), name="j", workload="digits-mlp", spec={},
        min_workers=1, max_workers=1, priority="guaranteed", consistency="strict", total_steps=10, state=source,
    )
    if (source, target) in ALLOWED:
        assert job.claim(target)
    else:
        with pytest.raises(InvalidTransition, match=f"from '{source.value}' to '{target.value}'"):
            job.claim(target)
    assert Job.objects.get(pk=job.pk).state == (target if (source, target) in ALLOWED else source)


@pytest.mark.parametrize(
    "source,target", sorted(set(itertools.product(JobState, JobState)) - ALLOWED)
)
def test_unlisted_transition_is_refused(source: JobState, target: JobState) -> None:
    with pytest.raises(InvalidTransition, match=f"from '{source.value}' to '{target.value}'"):
        check_transition(source, target)


def test_final_states_have_no_way_out() -> None:
    for state in FINAL_STATES:
        assert TRANSITIONS[state] == frozenset()


def test_the_docstring_lists_every_transition() -> None:
    import portal.jobs.states as states

    doc = states.__doc__ or ""
    for source, target in ALLOWED:
        assert f"{source.value:<10} -> {target.value}" in doc, (source, target)


@pytest.mark.django_db
def test_claim_moves_once(users: dict) -> None:
    from portal.jobs.models import Job

    job = Job.objects.create(
        owner=users["alice"], name="j", workload="digits-mlp", spec={}, min_workers=1, max_workers=1,
        priority="guaranteed", consistency="strict", total_steps=10,
    )
    stale_copy = Job.objects.get(pk=job.pk)
    assert job.claim(JobState.RUNNING)
    # A second deliverer read the job while it was queued: its claim must not move it again.
    assert not stale_copy.claim(JobState.RUNNING)
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    with pytest.raises(InvalidTransition):
        Job.objects.get(pk=job.pk).claim(JobState.RUNNING)
