"""A straggler through the whole platform: the simulated backend plays a slow device (`python -m
agent.simulate slow`), the worker on it stretches its compute, every rank reports its own step
times, the scheduler sees one rank well above its peers for twenty steps and migrates it to the
free device through an in-place resize (the other worker is not restarted), and the job's
throughput recovers."""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import pytest

from tests.platform import REDIS_URL, Platform, one_node_platform
from tests.test_integration_resize_in_place import ENDLESS, SPEC, cancel, live_rows, settled, steps_past

pytestmark = pytest.mark.slow

SLOWDOWN = 8.0
COMPUTE_BOUND = {"batch_size": 256, "hidden": 256, "layers": 2}
"""The job's model: a step whose compute outweighs the rest of it (the all-reduce, the reports).

Why these and not the integration tests' usual model (batch 32, hidden 128) at a 4x slowdown:
on this 2-core machine the straggler's replacement, device 2, has no core of its own (the
simulated backend pins device i to core i while there is one), so after the migration the two
workers share cores and a step's compute takes about twice as long. With compute c and the rest
of a step o, the recovery is (4c + o) / (2c + o): below 2x at best, and with the small model,
whose compute was about a sixth of a 10 ms step, 1.47-2.35x depending on the load, so a 1.5x
check failed under load. Here c is about 6 ms and o about 5 ms. At the test platform's pace
(agent --sim-pace) the slow device's compute is stretched in the paced device's time (8 x pace
x c), and each step is followed by pace - 1 times its CPU time: 4.5-5.5x quiet."""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with one_node_platform(tmp_path_factory.mktemp("platform"), 3) as running:
        yield running


def throughput(platform: Platform, job_id: int, generation: int) -> float:
    rates = [
        m["samples_per_s"]
        for m in platform.api("alice").get(f"/api/jobs/{job_id}/metrics").json()["points"]
        if m["generation"] == generation and m["samples_per_s"]
    ]
    assert len(rates) >= 5, rates
    return float(statistics.median(rates[2:]))


def test_a_slow_device_is_replaced_and_throughput_recovers(platform: Platform) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.simulate",
            "slow",
            "--redis-url",
            REDIS_URL,
            "--node",
            "node-a",
            "--device",
            "1",
            "--factor",
            str(SLOWDOWN),
            "--prefix",
            platform.env["BUNGEE_REDIS_PREFIX"],
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    alice = platform.api("alice")
    reply = alice.post("/api/jobs", json={**SPEC, "max_workers": 2, "steps": ENDLESS, "hyperparameters": COMPUTE_BOUND})
    job_id = reply.json()["id"]
    assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": 2}).status_code == 200
    # On a slow machine the migration may land before this test looks, so the first generation
    # on two workers is read from the job's history, not from what runs when it looks.
    settled(platform, job_id, 2)

    def migrated() -> dict[str, Any] | None:
        job = alice.get(f"/api/jobs/{job_id}").json()
        moved = [r for r in job["resizes"] if r["reason"] == "straggler replaced" and r["completed_at"]]
        return job if moved and job["state"] == "running" else None

    job = platform.wait_for("the straggler's migration", migrated, timeout_s=120)
    fast = settled(platform, job_id, 2, job["generation"] - 1)
    assert sorted(row["device_index"] for row in live_rows(fast)) == [0, 2]
    by_generation: dict[int, list[dict[str, Any]]] = {}
    for row in fast["workers_history"]:
        by_generation.setdefault(row["generation"], []).append(row)
    first = by_generation[min(g for g, rows in by_generation.items() if len(rows) == 2)]
    assert sorted(row["device_index"] for row in first) == [0, 1], "it started on the slow device"
    keeper = next(row["pid"] for row in first if row["device_index"] == 0)
    assert keeper in {row["pid"] for row in live_rows(fast)}, "the other worker was not restarted"
    steps_past(platform, job_id, fast["steps_done"] + 200)
    before, after = (
        throughput(platform, job_id, first[0]["generation"]),
        throughput(platform, job_id, fast["generation"]),
    )
    print(
        f"\nthroughput with a {SLOWDOWN:g}x slow device: {before:.0f} samples/s; after its migration: {after:.0f}"
    )
    assert after > 1.5 * before
    cancel(platform, job_id)
