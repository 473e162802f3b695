"""Opportunistic reclaim through the whole platform (API, Celery scheduler, a real agent, real
torch workers): an opportunistic job pinned to three workers borrows a device that belongs to
carol. Carol comes back (the simulated backend plays her, `python -m agent.simulate owner`):
the worker on her device leaves (the issue asks for two seconds; the time is printed, not
asserted: speed belongs to benchmarks and notes), the job trains on with its other two workers
(the same processes), and the unmet pin is reported. She leaves: the device is lent again and
the pin is met. Two rounds; the time from the owner's arrival to the borrowing worker's exit
is printed for each and its min/median/max at the end."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import psutil
import pytest

from agent.supervisor import SupervisorConfig
from tests.platform import REDIS_URL, Platform, one_node_platform
from tests.test_integration_resize_in_place import (
    ENDLESS,
    SPEC,
    cancel,
    detail,
    live_rows,
    pids_by_generation,
    settled,
    steps_past,
)

pytestmark = pytest.mark.slow

ROUNDS = 2
LEAVE_DEADLINE_S = SupervisorConfig().leave_grace_s + 60
"""The agent kills a leaver that has not left leave_grace_s after its generation reached the
node; the scheduler's replanning comes before that."""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with one_node_platform(tmp_path_factory.mktemp("platform"), 3) as running:
        running.group.run("manage.py", "device_owner", "node-a", "2", "--owner", "carol")
        yield running


def play_owner(platform: Platform, present: bool) -> None:
    flag = "--present" if present else "--absent"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.simulate",
            "owner",
            "--redis-url",
            REDIS_URL,
            "--node",
            "node-a",
            "--device",
            "2",
            flag,
            "--prefix",
            platform.env["BUNGEE_REDIS_PREFIX"],
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


def exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def phases(platform: Platform, job_id: int, sent_at: float) -> str:
    """Where the time went: the new generation written, the worker's "left" log line."""
    from datetime import datetime

    job = detail(platform, job_id)
    written = datetime.fromisoformat(job["resizes"][-1]["requested_at"]).timestamp()
    lines = platform.api("alice").get(f"/api/jobs/{job_id}/logs").json()
    left = [
        datetime.fromisoformat(entry["at"]).timestamp()
        for entry in lines
        if entry["line"].startswith("left the job")
    ]
    return (
        f"generation written +{written - sent_at:.3f} s, worker left +{left[-1] - sent_at:.3f} s"
        if left
        else ""
    )


def holder_of_device_2(platform: Platform) -> str:
    [node] = platform.api("alice").get("/api/cluster").json()["nodes"]
    return str(node["devices"][2]["holder"])


def test_the_owner_takes_the_device_back_and_the_job_trains_on(platform: Platform) -> None:
    alice = platform.api("alice")
    reply = alice.post(
        "/api/jobs", json={**SPEC, "name": "borrower", "priority": "opportunistic", "steps": ENDLESS}
    )
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["id"]
    assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": 3}).status_code == 200
    job = settled(platform, job_id, 3)
    assert "borrowed device" in job["schedule_reasons"] and job["pin_problem"] == ""
    leave_times = []
    for _ in range(ROUNDS):
        job = steps_past(platform, job_id, job["steps_done"] + 20)
        borrowing = next(row for row in live_rows(job) if row["device_index"] == 2)
        others = {row["pid"] for row in live_rows(job)} - {borrowing["pid"]}

        asked = time.monotonic()
        play_owner(platform, present=True)
        sent, sent_at = time.monotonic(), time.time()
        # Waited for as long as the agent lets a leaver run (then it kills it, which the row's
        # reason below tells apart); polled often, as the time it takes is printed.
        platform.wait_for(
            "the borrowing worker to leave", partial(exited, borrowing["pid"]), timeout_s=LEAVE_DEADLINE_S, every_s=0.005
        )
        leave_s = time.monotonic() - sent
        leave_times.append(leave_s)
        print(
            f"\nowner back -> borrowing worker exited: {leave_s:.3f} s after the command was on the "
            f"stream ({time.monotonic() - asked:.3f} s counting the CLI's start); {phases(platform, job_id, sent_at)}"
        )

        # The job trains on with the same two processes; the unmet pin is reported.
        shrunk = settled(platform, job_id, 2, job["generation"])
        [left] = [
            row for row in shrunk["workers_history"]
            if row["pid"] == borrowing["pid"] and row["generation"] == borrowing["generation"]
        ]
        assert (left["state"], left["reason"]) == ("exited", "left"), "it left at a step boundary, not killed"
        assert others <= pids_by_generation(shrunk)[shrunk["generation"]], shrunk["workers_history"]
        assert {row["pid"] for row in live_rows(shrunk)} == others
        assert shrunk["resizes"][-1]["reason"] == "owner reclaimed a device"
        assert "pin unmet" in shrunk["schedule_reasons"]
        assert shrunk["pin_problem"].startswith("pinned to 3 workers but given 2")
        assert holder_of_device_2(platform) == "owner"
        steps_past(platform, job_id, shrunk["steps_done"] + 20)

        # Carol leaves: the device is lent again and the pin met, the survivors still running.
        play_owner(platform, present=False)
        job = settled(platform, job_id, 3, shrunk["generation"])
        assert others <= {row["pid"] for row in live_rows(job)}
        assert "borrowed device" in job["schedule_reasons"] and job["pin_problem"] == ""

    print(
        f"\nreclaim over {ROUNDS} rounds: min {min(leave_times):.3f} s, median "
        f"{statistics.median(leave_times):.3f} s, max {max(leave_times):.3f} s"
    )
    cancel(platform, job_id)
