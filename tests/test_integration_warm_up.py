"""Joiners caught while warming up, through the whole platform (the module's platform is that of
test_integration_resize_in_place, with cold joiners): one killed, and one that hangs, which the
portal expires at the warm-up deadline. Either way the survivors train on, the device comes back
with a new joiner, and every step is trained once on exactly its batch."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from elastic.worker.data import SampleStream
from tests.platform import Platform
from tests.test_integration_resize_in_place import (
    BATCH,
    SEED,
    assert_true_allocation,
    cancel,
    detail,
    inplace_platform,
    live_rows,
    logs,
    loss_fell,
    no_job_left,
    pin,
    settled,
    steps_past,
    submit,
)
from tests.worker_support import DIGITS_SAMPLES, Ledger

pytestmark = pytest.mark.slow

__all__ = ["no_job_left"]  # the fixture that cancels what a failed test left running

WARMUP_TIMEOUT_S = 25


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples") / "samples.jsonl"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, record: Path) -> Any:
    env = {
        # A joiner that hangs is given up on after this: 5x what a cold joiner takes beside this
        # module's workers (about 5 s); a machine at load 13-17 took 15-20 s.
        "BUNGEE_WARMUP_TIMEOUT_S": str(WARMUP_TIMEOUT_S),
        # Cold joiners: these tests stop or kill a joiner before it is ready, and one born from
        # a warm standby is ready about 0.5 s after its launch, often before the portal lists it
        # (it then failed the group's formation instead of its warm-up: seen twice in a row here).
        "BUNGEE_STANDBYS": "off",
    }
    with inplace_platform(tmp_path_factory, record, env) as running:
        yield running


def grow_2_to_3(platform: Platform) -> tuple[int, set[int], dict[str, Any]]:
    """A job settled on 2 workers, then pinned to 3: returns its id, its survivors' pids and the
    joiner's row as soon as the joiner has started (it is warming up)."""
    job_id = submit(platform, 2)
    survivors = {row["pid"] for row in live_rows(settled(platform, job_id, 2))}
    pin(platform, job_id, 3)

    def joiner() -> dict[str, Any] | None:
        rows = [row for row in live_rows(detail(platform, job_id)) if row["pid"] not in survivors]
        return rows[0] if rows else None

    return job_id, survivors, platform.wait_for("the joiner to start", joiner, every_s=0.05)


def test_a_joiner_killed_while_warming_up(platform: Platform, record: Path) -> None:
    job_id, survivors, warming = grow_2_to_3(platform)
    os.kill(warming["pid"], signal.SIGKILL)
    killed_at = detail(platform, job_id)
    assert killed_at["state"] == "resizing", "the joiner had not joined yet"
    # The job trains on meanwhile, and the scheduler plans again: first without the device, then
    # (the device is fine) with a new joiner on it.
    steps_past(platform, job_id, killed_at["steps_done"] + 50)
    job = settled(platform, job_id, 3, killed_at["generation"])
    assert job["restarts"] == 1 and survivors <= {row["pid"] for row in live_rows(job)}
    assert warming["pid"] not in {row["pid"] for row in live_rows(job)}
    assert_true_allocation(job)
    steps_past(platform, job_id, job["steps_done"])
    cancel(platform, job_id)
    Ledger.read(record, job_id).check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=3)
    assert loss_fell(platform, job_id)


def test_a_joiner_that_hangs_while_warming_up_is_expired(platform: Platform, record: Path) -> None:
    job_id, survivors, hung = grow_2_to_3(platform)
    os.kill(hung["pid"], signal.SIGSTOP)  # alive, but it never answers again
    try:
        hung_at = detail(platform, job_id)
        # Its own generation's line: an earlier generation of the job may have expired too (in
        # an xdist CI run at load 11 the job's first, three cold joiners, took more than 25 s).
        expired = f"generation {hung_at['generation']} expired"
        line = platform.wait_for(
            "the generation to expire",
            lambda: [entry for entry in logs(platform, job_id) if expired in entry],
            timeout_s=WARMUP_TIMEOUT_S + 30,
        )
        assert "not ready within" in line[0] and f"{hung['node']}/{hung['device_index']}" in line[0], line
        # The survivors trained on meanwhile; the device comes back with a new joiner once the
        # agent has killed the hung one (SIGTERM cannot reach a stopped process; SIGKILL does).
        steps_past(platform, job_id, hung_at["steps_done"] + 50)
        job = settled(platform, job_id, 3, hung_at["generation"], timeout_s=150)
    finally:
        if _alive(hung["pid"]):
            os.kill(hung["pid"], signal.SIGCONT)
    assert survivors <= {row["pid"] for row in live_rows(job)} and hung["pid"] not in {
        row["pid"] for row in live_rows(job)
    }
    assert job["restarts"] == 0, "a joiner planned out is no failure of the job"
    assert "a joiner never got ready" in [r["reason"] for r in job["resizes"]]
    assert_true_allocation(job)
    cancel(platform, job_id)
    Ledger.read(record, job_id).check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
