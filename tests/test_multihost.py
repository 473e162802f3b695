"""A job across real hosts: each agent (and so its workers) in a network namespace of its own,
with its own address on a bridge, where the portal and a Redis of the test's own listen.
Nothing reaches a host but over its link.

A job spans both hosts. One host is cut off mid-training (its link down): the portal finds it
lost, the job shrinks to the other host and trains on, and its timeline says why. When the link
comes back the node rejoins and the job grows back, its state crossing from one host's memory
to the other's.

Root only (ip netns); skipped elsewhere with the reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns import Network, hosts, why_not
from tests.platform import FAST_PROGRESS_ENV, Platform, redis_server, running_platform
from tests.test_integration_resize_in_place import (
    assert_true_allocation,
    cancel,
    live_rows,
    logs,
    settled,
    steps_past,
    submit,
)

REASON = why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

NODE_TIMEOUT_S = 6
PG_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    with hosts(["node-a", "node-b"]) as net:
        yield net


@pytest.fixture(scope="module")
def redis_url(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of the test's own, listening on the bridge (the machine's listens on loopback,
    which a host in a namespace does not share)."""
    with redis_server(network.gateway, tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="module")
def platform(
    network: Network, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    env = {
        **FAST_PROGRESS_ENV,
        "REDIS_URL": redis_url,
        "BUNGEE_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S),
        "BUNGEE_PG_TIMEOUT_S": str(PG_TIMEOUT_S),
        "BUNGEE_POLICY": "fair",
    }
    with running_platform(
        tmp_path_factory.mktemp("platform"), {"node-a": 1, "node-b": 1}, env, network
    ) as running:
        alice = running.api("alice")
        running.wait_for(
            "both hosts' devices",
            lambda: sum(len(n["devices"]) for n in alice.get("/api/cluster").json()["nodes"]) == 2,
        )
        yield running


def nodes(platform: Platform) -> dict[str, Any]:
    return {node["name"]: node for node in platform.api("alice").get("/api/cluster").json()["nodes"]}


def test_a_job_across_hosts_survives_a_host_cut_off_and_grows_back(platform: Platform, network: Network) -> None:
    job_id = submit(platform, 2)
    job = settled(platform, job_id, 2)
    assert {row["node"] for row in live_rows(job)} == {"node-a", "node-b"}, "the job spans both hosts"
    assert nodes(platform)["node-b"]["address"] == network.hosts["node-b"].address
    job = steps_past(platform, job_id, job["steps_done"] + 20)
    network.cut("node-b")
    cut_at = time.monotonic()
    try:
        shrunk = settled(platform, job_id, 1, job["generation"], timeout_s=NODE_TIMEOUT_S + PG_TIMEOUT_S + 60)
        shrunk_s = time.monotonic() - cut_at
        assert [row["node"] for row in live_rows(shrunk)] == ["node-a"]
        assert nodes(platform)["node-b"]["state"] == "lost"
        assert shrunk["resizes"][-1]["reason"] == "node lost", shrunk["resizes"]
        assert any("node node-b lost" in line for line in logs(platform, job_id))
        steps_past(platform, job_id, shrunk["steps_done"] + 20)
    finally:
        network.mend("node-b")
    mended_at = time.monotonic()
    platform.wait_for("node-b back", lambda: nodes(platform)["node-b"]["state"] == "online", timeout_s=60)
    regrown = settled(platform, job_id, 2, shrunk["generation"], timeout_s=120)
    assert {row["node"] for row in live_rows(regrown)} == {"node-a", "node-b"}
    grow = regrown["resizes"][-1]
    assert grow["bytes_moved"] and grow["bytes_moved"] > 0, f"the state crossed to node-b: {grow}"
    # Figures for the record (pytest -s), not asserted: cut to training on node-a alone, and
    # link back to training on both again.
    print(f"cut to shrunk {shrunk_s:.1f} s, mended to regrown {time.monotonic() - mended_at:.1f} s")
    assert_true_allocation(regrown)
    steps_past(platform, job_id, regrown["steps_done"] + 20)
    cancel(platform, job_id)
