"""Shared fixtures: a few users with tokens, API clients, and the Redis of this machine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

# The agents the tests start run their workers as the agent's user unless a test asks for
# confinement (tests/test_job_confinement.py): most tests' workers read and write files of the
# test's own (a stand-in worker's exit file, a task's marker), which a confined job cannot see.
os.environ.setdefault("BUNGEE_AGENT_ISOLATION", "none")

if TYPE_CHECKING:
    from elastic.wire import NodeRegistration, RunningWorker

LONGEST_FIRST = (
    "test_integration_slurm.py",
    "test_integration_resize_in_place.py",
    "test_integration_warm_up.py",
    "test_faults.py",
    "test_api_fuzz.py",
    "test_integration_drain.py",
    "test_job_confinement.py",
    "test_integration_backbone.py",
    "test_environment_import_check.py",
    "test_agent_standby.py",
    "test_browser_queue.py",
    "test_integration_slurm_on_demand.py",
    "test_worker_hybrid.py",
    "test_multihost.py",
    "test_slurm_preemption.py",
    "test_slurm_pool_pass.py",
    "test_slurm_confinement.py",
    "test_agent_process.py",
    "test_integration_agent_restart.py",
    "test_integration_stragglers.py",
    "test_integration_reclaim.py",
    "test_task_readers.py",
    "test_history_pruning.py",
    "test_worker_build.py",
    "test_agent_drain.py",
    "test_cli.py",
)
"""The suite's longest files (the CI log's slowest durations say which), in about that order:
run first, so that the xdist workers (`--dist loadfile --no-loadscope-reorder`, the
Makefile's) end together instead of one running the longest file alone at the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The LONGEST_FIRST files' tests first, in that order; the others after, as collected."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def users(db: Any) -> dict[str, Any]:
    from django.contrib.auth import get_user_model

    model = get_user_model()
    alice = model.objects.create_user("alice", password="alice-pass")
    bob = model.objects.create_user("bob", password="bob-pass")
    staff = model.objects.create_user("root", password="root-pass", is_staff=True)
    return {"alice": alice, "bob": bob, "staff": staff}


@pytest.fixture
def tokens(users: dict[str, Any]) -> dict[str, str]:
    from portal.accounts.models import ApiToken

    issued = {name: ApiToken.issue(user, f"{name} test")[1] for name, user in users.items()}
    issued["agent"] = ApiToken.issue(users["staff"], "agent test", ApiToken.Role.AGENT)[1]
    return issued


class ApiClient:
    """Django's test client speaking JSON with a bearer token."""

    def __init__(self, token: str | None) -> None:
        from django.test import Client

        self.client = Client()
        self.headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}

    def get(self, path: str, **params: Any) -> Any:
        return self.client.get(path, params, **self.headers)

    def post(self, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        import json

        data = body if isinstance(body, (str, bytes)) else json.dumps(body if body is not None else {})
        return self.client.post(path, data, content_type=content_type, **self.headers)


@pytest.fixture
def api(tokens: dict[str, str]) -> dict[str, ApiClient]:
    return {name: ApiClient(token) for name, token in tokens.items()} | {"anonymous": ApiClient(None)}


@pytest.fixture(scope="session", autouse=True)
def _no_redis_user_left() -> Iterator[None]:
    """At the end of the run: no Redis user of this run's prefix left on the machine's Redis (a
    registration or a publish made through the API, without the redis_client fixture, makes one)."""
    yield
    import redis
    from django.conf import settings

    from portal.redis import client

    try:
        made = [name for name in client().acl_users() if name.startswith(f"{settings.BUNGEE.redis_prefix}:")]
        if made:
            client().acl_deluser(*made)
    except redis.RedisError:
        pass  # Redis away at the end: nothing of this run there to remove


@pytest.fixture
def redis_client() -> Any:
    from portal.redis import client

    redis = client()
    yield redis
    from django.conf import settings

    for stale in redis.scan_iter(f"{settings.BUNGEE.redis_prefix}:*"):
        redis.delete(stale)
    # The users of the test's nodes and jobs (portal.redis_users), named under the same prefix.
    users = [name for name in redis.acl_users() if name.startswith(f"{settings.BUNGEE.redis_prefix}:")]
    if users:
        redis.acl_deluser(*users)


def cluster_registration(*running: RunningWorker) -> NodeRegistration:
    """What the agent of the `cluster` fixture's node sends when it registers, naming the
    workers it still runs (none when it first starts)."""
    from elastic.wire import DeviceInfo, NodeRegistration

    return NodeRegistration(
        name="node-a",
        address="127.0.0.1",
        backend="simulated",
        devices=[
            DeviceInfo(index=i, uuid=f"sim-{i}", name="CPU slot", kind="cpu-slot", memory_total_bytes=2**30)
            for i in range(4)
        ],
        running=list(running),
    )


@pytest.fixture
def cluster(db: Any, redis_client: Any) -> Any:
    """One online node with four simulated devices, registered the way an agent does it."""
    from portal.cluster.ingest import register_node

    node, _ = register_node(cluster_registration())
    return node


VALID_SPEC = {
    "name": "mlp",
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 2,
    "steps": 50,
}

MODE_FIELDS = (
    "virtual_workers",
    "batch_per_worker",
    "min_batch_size",
    "max_batch_size",
    "lr_scaling",
    "warmup_steps",
)
"""The fields of a job's consistency mode: V (strict), the batch bounds and the rate's rules (hybrid)."""


@pytest.fixture(scope="session")
def browser_platform(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The whole platform with one agent of four simulated devices, shared by the browser tests."""
    from tests.platform import running_platform

    with running_platform(tmp_path_factory.mktemp("browser-platform"), {"node-b": 4}) as platform:
        platform.wait_for("the agent's devices", lambda: sum(
            len(n["devices"]) for n in platform.api("alice").get("/api/cluster").json()["nodes"]) == 4)
        yield platform


@pytest.fixture(autouse=True)
def _browser_cluster_freed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test on the shared browser platform, passed or failed: no job left running,
    so that one test's failure does not become the next one's (a full cluster)."""
    yield
    if "browser_platform" in request.fixturenames:
        from tests.browser_support import free_the_cluster

        free_the_cluster(request.getfixturevalue("browser_platform"))


@pytest.fixture(scope="module")
def chromium() -> Any:
    """One Chromium per browser test module: under pytest-xdist a worker runs other modules
    between two browser ones, and none of them runs beside Playwright's sync loop."""
    from playwright.sync_api import sync_playwright

    from tests.browser_support import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """torch.distributed's default process group: a gloo group of this process alone, for a
    trainer driven in the test's own process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def bound() -> Iterator[list[Any]]:
    """Tasks a test binds (elastic.tasks.runtime.BoundTask), closed (their readers stopped) after it."""
    tasks: list[Any] = []
    yield tasks
    for task in tasks:
        task.close()
