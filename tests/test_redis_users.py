"""The Redis users of jobs and agents, against the machine's real Redis: a published job's
launch carries the URL of the job's own user, which reaches the job's keys and nothing else (no
node's command stream, no other job, no Celery queue, no listing of keys); a node's user reads
its own stream only; a re-registration changes the node's password and the old one stops
working; a job's user goes when the job has ended and its last worker stopped; the beat's tick makes every user again after Redis
lost them."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import redis
from django.conf import settings

from elastic.wire import AgentReport, LaunchCommand, WorkerEvent, coordination_key, parse_command
from portal import redis_users
from portal.cluster.ingest import register_node
from portal.cluster.models import Node
from portal.dispatch import stream_for
from portal.jobs import lifecycle
from portal.jobs.agents import ingest_report
from portal.jobs.models import Job
from portal.scheduling.cycle import run_cycle
from portal.scheduling.tasks import tick
from tests.conftest import VALID_SPEC, cluster_registration

pytestmark = pytest.mark.django_db

NOPERM = (redis.exceptions.NoPermissionError, redis.exceptions.ResponseError)
"""What Redis answers a user beyond its rights: NOPERM (a script's call beyond them is a plain error)."""


@pytest.fixture
def as_user() -> Iterator[Any]:
    """Opens clients at URLs given, and closes them."""
    opened: list[redis.Redis] = []

    def connect(url: str) -> redis.Redis:
        opened.append(redis.Redis.from_url(url, decode_responses=True, socket_timeout=5))
        return opened[-1]

    yield connect
    for one in opened:
        one.close()


def submit_and_publish(api: dict) -> tuple[Job, LaunchCommand]:
    reply = api["alice"].post("/api/jobs", VALID_SPEC)
    assert reply.status_code == 201, reply.content
    job = Job.objects.get(pk=reply.json()["id"])
    assert run_cycle().launched_jobs == [job.pk]
    [launch] = [c for c in commands("node-a") if isinstance(c, LaunchCommand) and c.job_id == job.pk]
    return job, launch


def commands(node: str) -> list[Any]:
    from portal.redis import client

    return [parse_command(fields["command"]) for _, fields in client().xrange(stream_for(node))]


def refused(call: Any) -> bool:
    try:
        call()
    except NOPERM as err:
        return "permission" in str(err).lower() or "noperm" in str(err).lower() or "access" in str(err).lower()
    return False


def test_a_jobs_user_reaches_its_own_keys_and_nothing_else(
    api: dict, cluster: Node, redis_client: redis.Redis, as_user: Any
) -> None:
    job, launch = submit_and_publish(api)
    assert unquote(urlsplit(launch.redis_url).username or "") == redis_users.job_username(job.pk)
    worker = as_user(launch.redis_url)
    own = launch.coordination_key
    assert worker.get(f"{own}:latest") == "1", "the job's workers read their membership record"
    worker.sadd(f"{own}:ready:1", "node-a/0")
    worker.rpush(f"{own}:go:1", "go")
    assert worker.blpop([f"{own}:go:1"], timeout=1) == (f"{own}:go:1", "go")

    other_job = coordination_key(job.pk + 1000, settings.BUNGEE.redis_prefix)
    redis_client.set(f"{other_job}:latest", "3")
    node_stream = stream_for(cluster.name)
    celery_queue = settings.CELERY_TASK_DEFAULT_QUEUE
    redis_client.rpush(celery_queue, "a task")
    try:
        attempts = {
            "XADD a stop to the node's stream": lambda: worker.xadd(
                node_stream, {"command": '{"kind":"stop","job_id":1,"before_generation":99}'}),
            "XADD a drain to the node's stream": lambda: worker.xadd(
                node_stream, {"command": '{"kind":"drain","cause":"preempted","deadline_s":1}'}),
            "read the node's stream": lambda: worker.xrange(node_stream),
            "read another job's key": lambda: worker.get(f"{other_job}:latest"),
            "write another job's key": lambda: worker.set(f"{other_job}:latest", "99"),
            "read another job's key from a script": lambda: worker.eval(
                "return redis.call('GET', KEYS[1])", 1, f"{other_job}:latest"),
            "read Celery's queue": lambda: worker.lrange(celery_queue, 0, -1),
            "push to Celery's queue": lambda: worker.lpush(celery_queue, "forged"),
            "read Celery's bindings": lambda: worker.smembers(f"_kombu.binding.{celery_queue}"),
            "list the keys (SCAN)": lambda: worker.scan(0),
            "list the keys (KEYS)": lambda: worker.keys("*"),
            "list the users": lambda: worker.acl_users(),
            "make a user": lambda: worker.acl_setuser("forged", enabled=True, nopass=True),
            "read the configuration": lambda: worker.config_get("*"),
            "publish on another job's channel": lambda: worker.publish(f"{other_job}:events", "x"),
        }
        allowed = [what for what, attempt in attempts.items() if not refused(attempt)]
        assert allowed == [], f"a job's user could {allowed}"
        assert redis_client.lrange(celery_queue, 0, -1) == ["a task"]
        assert redis_client.get(f"{other_job}:latest") == "3"
        assert redis_client.xlen(node_stream) == len(commands(cluster.name))
    finally:
        redis_client.delete(celery_queue)


def test_a_nodes_user_reads_its_own_stream_only(
    api: dict, cluster: Node, redis_client: redis.Redis, as_user: Any
) -> None:
    job, launch = submit_and_publish(api)
    _, reply = register_node(cluster_registration().model_copy(update={"running": []}))
    other, _ = register_node(cluster_registration().model_copy(update={"name": "node-b"}))
    agent = as_user(reply.commands_redis_url)
    assert unquote(urlsplit(reply.commands_redis_url).username or "") == redis_users.node_username("node-a")
    entries = agent.xrange(reply.commands_stream)
    assert entries and agent.xrevrange(reply.commands_stream, count=1)[0] == entries[-1]
    assert agent.xread({reply.commands_stream: "0"}, count=1)
    assert agent.time()
    attempts = {
        "write its own stream": lambda: agent.xadd(reply.commands_stream, {"command": "{}"}),
        "read another node's stream": lambda: agent.xrange(stream_for(other.name)),
        "read a job's membership": lambda: agent.get(f"{launch.coordination_key}:latest"),
        "write a job's membership": lambda: agent.set(f"{launch.coordination_key}:latest", "9"),
        "read Celery's queue": lambda: agent.lrange(settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1),
        "list the keys": lambda: agent.scan(0),
    }
    allowed = [what for what, attempt in attempts.items() if not refused(attempt)]
    assert allowed == [], f"a node's user could {allowed}"


def test_a_registration_gives_a_new_password_and_the_old_one_stops_working(
    db: Any, redis_client: redis.Redis, as_user: Any
) -> None:
    _, first = register_node(cluster_registration())
    old_agent = as_user(first.commands_redis_url)
    assert old_agent.xlen(first.commands_stream) == 0
    node, second = register_node(cluster_registration())
    assert second.commands_redis_url != first.commands_redis_url
    with pytest.raises(redis.ConnectionError):
        old_agent.xlen(first.commands_stream)  # the connection made with the old password is closed
    with pytest.raises(redis.AuthenticationError):
        as_user(first.commands_redis_url).ping()
    assert as_user(second.commands_redis_url).xlen(second.commands_stream) == 0
    password = unquote(urlsplit(second.commands_redis_url).password or "")
    node.refresh_from_db()
    assert node.redis_password_sha256 == hashlib.sha256(password.encode()).hexdigest()
    assert password not in str(Node.objects.filter(pk=node.pk).values().get()), "the password is stored"


def test_a_jobs_user_goes_when_the_job_ends(api: dict, cluster: Node, redis_client: redis.Redis, as_user: Any) -> None:
    job, launch = submit_and_publish(api)
    worker = as_user(launch.redis_url)
    assert worker.get(f"{launch.coordination_key}:latest") == "1"
    assert lifecycle.cancel(job)
    assert redis_client.acl_getuser(redis_users.job_username(job.pk)) is None
    with pytest.raises(redis.ConnectionError):
        worker.get(f"{launch.coordination_key}:latest")
    with pytest.raises(redis.AuthenticationError):
        as_user(launch.redis_url).ping()


def test_a_jobs_user_outlives_the_job_until_its_last_worker_stopped(
    api: dict, cluster: Node, redis_client: redis.Redis, as_user: Any
) -> None:
    """A worker told to stop saves its state and leaves through its board: its user goes with the
    last worker's exit, and the tick keeps it meanwhile."""
    job, launch = submit_and_publish(api)
    report(cluster, *(worker_event(job, "joined", rank, pid=1000 + rank, device_index=rank) for rank in (0, 1)))
    stopping = as_user(launch.redis_url)
    assert stopping.get(f"{launch.coordination_key}:latest") == "1"
    assert lifecycle.cancel(job)
    assert stopping.get(f"{launch.coordination_key}:latest") == "1", "a stopping worker lost its board"
    tick()
    assert stopping.get(f"{launch.coordination_key}:latest") == "1", "the tick took a stopping worker's board"
    report(cluster, worker_event(job, "exited", 1, reason="stopped", exit_code=0, device_index=1))
    assert stopping.get(f"{launch.coordination_key}:latest") == "1"
    report(cluster, worker_event(job, "exited", 0, reason="stopped", exit_code=0, device_index=0))
    assert redis_client.acl_getuser(redis_users.job_username(job.pk)) is None
    with pytest.raises(redis.ConnectionError):
        stopping.get(f"{launch.coordination_key}:latest")


def worker_event(job: Job, kind: str, rank: int, **fields: Any) -> WorkerEvent:
    return WorkerEvent(job_id=job.pk, generation=1, rank=rank, kind=kind, at=time.time(), **fields)


def report(node: Node, *events: WorkerEvent) -> None:
    ingest_report(node, AgentReport(node=node.name, events=list(events)))


def test_the_tick_makes_every_user_again_after_redis_lost_them(
    api: dict, cluster: Node, redis_client: redis.Redis, as_user: Any
) -> None:
    job, launch = submit_and_publish(api)
    _, reply = register_node(cluster_registration())
    ended = coordination_key(job.pk + 1000, settings.BUNGEE.redis_prefix)
    redis_client.acl_setuser(ended, enabled=True, nopass=True)  # a user left behind by a job that ended
    for user in (redis_users.job_username(job.pk), redis_users.node_username(cluster.name)):
        redis_client.acl_deluser(user)  # as a Redis that restarted empty
    tick()
    assert as_user(launch.redis_url).get(f"{launch.coordination_key}:latest") == "1"
    assert as_user(reply.commands_redis_url).xlen(reply.commands_stream) >= 1
    assert redis_client.acl_getuser(ended) is None
