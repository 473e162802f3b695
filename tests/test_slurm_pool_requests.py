"""The Slurm pool's passes on demand (portal.trigger.request_pool_pass, portal.slurm.tasks), on
the machine's Redis and the test database: a burst of requests is one waiting pass; a pass in
flight takes the requests in before it reads anything, so that one more waits at most; a task
whose request an earlier pass took in does nothing; the events where demand appears each ask for
a pass, and nothing asks where no pool is configured.

The hooks are observed with a pass held in flight (the test holds the pool's lock), so that the
task Celery runs at once here (eager) is turned away and leaves the request waiting, with the
reason of the event that asked: no Slurm is needed. The passes themselves, against a real Slurm,
are tests/test_integration_slurm_on_demand.py's."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from elastic.spec import validate_spec
from elastic.wire import DrainNotice
from portal.cluster import drain
from portal.cluster.models import Device, Node
from portal.jobs import lifecycle
from portal.jobs.models import Job
from portal.jobs.services import request_resize
from portal.redis import key
from portal.slurm import tasks
from portal.slurm.pool import PassResult
from portal.slurm.tasks import MAX_ROUNDS, run_passes, size_slurm_pool
from portal.trigger import POOL_REQUEST_TTL_S, PoolRequests, request_pool_pass
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


class HeldLock:
    """The lock as run_passes sees it, counting its renewals (one per pass)."""

    def __init__(self) -> None:
        self.renewed = 0

    def reacquire(self) -> bool:
        self.renewed += 1
        return True


@pytest.fixture
def requests(redis_client: Any) -> PoolRequests:
    return PoolRequests.of_this_deployment()


@pytest.fixture
def pool_on(settings: Any, tmp_path: Any) -> None:
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={
        "enabled": True, "portal_url": "http://127.0.0.1:9", "token_file": str(tmp_path / "pool.token"),
        "gres": "slot:1",
    })


@pytest.fixture
def pass_in_flight(redis_client: Any, pool_on: None) -> Iterator[None]:
    """The pool's lock held, as a running pass holds it."""
    lock = redis_client.lock(key("slurm", "pool", "lock"), timeout=60, blocking=False)
    assert lock.acquire()
    yield
    lock.release()


def test_a_burst_of_requests_is_one_waiting_pass(requests: PoolRequests) -> None:
    assert requests.ask("job 1 submitted")
    assert not any(requests.ask(f"job {n} submitted") for n in range(2, 12))
    ttl_ms = requests.redis.pttl(requests.name)
    assert 0 < ttl_ms <= POOL_REQUEST_TTL_S * 1000, "a request no pass takes in expires"
    assert requests.take() == "job 1 submitted"
    assert requests.take() is None
    # Taken in by a pass in flight: the next event asks again, and that one waits.
    assert requests.ask("node slurm-a-job3 drains")
    assert not requests.ask("node slurm-a-job3 drained")
    assert requests.waiting()


def test_requests_during_a_pass_give_one_more_pass(requests: PoolRequests) -> None:
    seen: list[str | None] = []

    def one_pass() -> PassResult:
        if not seen:  # a burst of events while the first pass runs
            for n in range(10):
                requests.ask(f"event {n}")
        seen.append(requests.redis.get(requests.name))
        return PassResult()

    requests.ask("job 1 submitted")
    lock = HeldLock()
    assert len(run_passes(requests, lock, one_pass, beat=False)) == 2
    assert seen == ["event 0", None], "the second pass took the burst in before it ran"
    assert lock.renewed == 2 and not requests.waiting()


def test_a_task_whose_request_was_taken_in_runs_no_pass(requests: PoolRequests) -> None:
    passes: list[int] = []
    assert run_passes(requests, HeldLock(), lambda: passes.append(1) or PassResult(), beat=False) == []
    assert passes == []


def test_the_beat_runs_a_pass_and_takes_a_waiting_request_in(requests: PoolRequests) -> None:
    assert len(run_passes(requests, HeldLock(), PassResult, beat=True)) == 1
    requests.ask("job 1 submitted")
    assert len(run_passes(requests, HeldLock(), PassResult, beat=True)) == 1
    assert not requests.waiting()


def test_requests_that_keep_coming_are_left_waiting_after_the_most_rounds(requests: PoolRequests) -> None:
    def one_pass() -> PassResult:
        requests.ask("again")
        return PassResult()

    requests.ask("first")
    assert len(run_passes(requests, HeldLock(), one_pass, beat=False)) == MAX_ROUNDS
    assert requests.waiting(), "the task queues itself again for it"


def test_a_task_turned_away_by_a_pass_in_flight_leaves_its_request_waiting(
    pass_in_flight: None, requests: PoolRequests
) -> None:
    requests.ask("job 1 submitted")
    assert size_slurm_pool("job 1 submitted") is None
    assert requests.take() == "job 1 submitted"


def test_nothing_asks_where_no_pool_is_configured(
    settings: Any, requests: PoolRequests, django_capture_on_commit_callbacks: Any
) -> None:
    assert not settings.BUNGEE_SLURM.enabled
    with django_capture_on_commit_callbacks(execute=True) as queued:
        request_pool_pass("job 1 submitted")
    assert queued == [] and not requests.waiting()
    assert size_slurm_pool("job 1 submitted") is None


def test_nothing_asks_where_the_pool_acts_on_its_beat_only(
    settings: Any, pool_on: None, requests: PoolRequests, django_capture_on_commit_callbacks: Any
) -> None:
    settings.BUNGEE_SLURM = settings.BUNGEE_SLURM.model_copy(update={"on_demand": False})
    with django_capture_on_commit_callbacks(execute=True) as queued:
        request_pool_pass("job 1 submitted")
    assert queued == [] and not requests.waiting()


def test_a_request_waits_for_its_transaction(
    pass_in_flight: None, requests: PoolRequests, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=False) as queued:
        request_pool_pass("job 1 submitted")
    assert len(queued) == 1 and not requests.waiting(), "nothing before the commit"
    queued[0]()
    assert requests.take() == "job 1 submitted"


def _node(name: str, devices: int, **fields: Any) -> Node:
    node = Node.objects.create(name=name, address="127.0.0.1", backend="simulated",
                               last_seen_at=fields.pop("last_seen_at", timezone.now()), **fields)
    for index in range(devices):
        Device.objects.create(node=node, index=index, uuid=f"{name}-{index}", name="slot", kind="cpu-slot")
    return node


def _asked(requests: PoolRequests, django_capture_on_commit_callbacks: Any, event: Any) -> str | None:
    with django_capture_on_commit_callbacks(execute=True):
        event()
    return requests.take()


def test_the_events_of_new_demand_ask_for_a_pass(
    pass_in_flight: None, requests: PoolRequests, users: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    def asked(event: Any) -> str | None:
        return _asked(requests, django_capture_on_commit_callbacks, event)

    job = Job.objects.create(owner=users["alice"], name="grows", workload="digits-mlp", spec=VALID_SPEC,
                             min_workers=1, max_workers=2, priority="guaranteed", consistency="strict",
                             total_steps=50)
    submitted = asked(lambda: lifecycle.create_job(users["alice"], validate_spec(VALID_SPEC)))
    assert submitted is not None and submitted.endswith("submitted")

    _node("fixed", 2)
    assert asked(lambda: request_resize(job, 2, users["alice"])) == f"job {job.pk} resize to 2"
    assert asked(lambda: request_resize(job, None, users["alice"])) is None, "a pin lifted asks for nothing more"

    preempted = _node("slurm-host-job7", 1)
    notice = DrainNotice(cause="slurm_preemption", deadline_at=(timezone.now() + timedelta(seconds=20)).timestamp())
    assert asked(lambda: drain.draining(preempted, notice)) == "node slurm-host-job7 drains: node preempted by Slurm"
    assert asked(lambda: drain.left(preempted)) == "node slurm-host-job7 drained"

    _node("silent", 1, last_seen_at=timezone.now() - timedelta(hours=1))
    assert asked(lifecycle.nodes_lost) == "node(s) silent lost"


def test_the_task_is_the_one_the_requests_name() -> None:
    from portal.trigger import POOL_TASK

    assert tasks.size_slurm_pool.name == POOL_TASK
