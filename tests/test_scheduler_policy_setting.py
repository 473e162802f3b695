"""The scheduling policy is a setting: the cycle runs the one named (and records it), a name that
is no policy stops the portal and the Celery worker at start with the name quoted, and so does
a negative resize cost."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from portal.jobs.models import Job
from portal.scheduling.cycle import run_cycle
from portal.scheduling.models import SchedulerDecision
from portal.scheduling.policy import check_policy_setting
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


def test_the_default_is_bungee_with_the_measured_resize_cost(settings: Any) -> None:
    assert settings.BUNGEE.policy == "bungee" and settings.BUNGEE.resize_cost_s == 1.0
    assert check_policy_setting() == []


@pytest.mark.parametrize(
    "change,quoted",
    [({"policy": "round-robin"}, "BUNGEE_POLICY='round-robin'"), ({"resize_cost_s": -2.0}, "-2.0")],
)
def test_a_bad_setting_is_a_system_check_error(settings: Any, change: dict, quoted: str) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update=change)
    [error] = check_policy_setting()
    assert error.id == "bungee.E001" and quoted in error.msg
    if "policy" in change:
        assert "bungee, saxena, fair, fifo, tiresias, optimus" in error.msg


@pytest.mark.parametrize("policy", ["fifo", "fair", "bungee"])
def test_the_cycle_runs_the_configured_policy(api: dict, cluster: Any, settings: Any, policy: str) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"policy": policy})
    reply = api["alice"].post("/api/jobs", {**VALID_SPEC, "max_workers": 3})
    job_id = reply.json()["id"]
    run_cycle()
    decision = SchedulerDecision.objects.first()
    assert decision is not None and decision.policy == policy and decision.decision_ms > 0
    [row] = decision.jobs
    assert row["id"] == job_id and row["reasons"] and row["note"]
    job = Job.objects.get(pk=job_id)
    assert len(row["target"]) == job.allocations.count() > 0
    if policy == "fifo":
        assert row["reasons"] == ["requested gang"] and len(row["target"]) == 3


def _start(argv: list[str], policy: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "BUNGEE_POLICY": policy}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv",
    [
        ["manage.py", "check"],
        ["-m", "celery", "-A", "portal", "worker", "-Q", f"policy-check-{os.getpid()}", "--pool", "solo"],
        ["-c", "import portal.asgi"],
    ],
    ids=["manage-check", "celery-worker", "asgi-portal"],
)
def test_an_unknown_policy_stops_each_process_at_start(argv: list[str]) -> None:
    started = _start(argv, "no-such-policy")
    assert started.returncode != 0
    assert "BUNGEE_POLICY='no-such-policy' is not a scheduling policy" in started.stderr + started.stdout
