"""The Redis ACL users of agents and jobs: the one module that makes, re-makes and removes them.

Redis asks every client for credentials. The portal and Celery connect as their own user (the
deployment makes it: REDIS_URL carries it); that user makes the others here:

- a node's user, made at each registration with a fresh random password: it may only read the
  node's keys (its command stream, elastic.wire.command_stream). The database keeps the
  password's SHA-256 (Node.redis_password_sha256), never the password: Redis takes the hash
  itself, so the user can be made again without it.
- a job's user, made when a generation of the job is published and removed once the job has
  ended and none of its workers runs (portal.jobs.lifecycle):
  it may read and write the job's keys and channels only (its membership board,
  elastic.wire.coordination_key). Its password is derived from SECRET_KEY and the user's name,
  the same at every publish, so a worker that reconnects after Redis restarted finds it valid.

Neither may list keys (SCAN, KEYS), read another user's keys, run admin commands or change
users. Redis is transport: a Redis that restarted empty has lost these users, and the beat's
tick makes the users of every job that is active or still has running workers, and of every
known node, again from the database (`sync`), as a publish and a registration do for theirs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable, Mapping
from functools import cache
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from django.conf import settings

from elastic.wire import command_stream, coordination_key
from portal.redis import client

log = logging.getLogger(__name__)

_NO_LISTING = ["-@dangerous", "-@admin", "-scan", "-keys", "-randomkey", "-dbsize", "-pubsub"]
"""What no agent or job may run even on its own keys: listing the keyspace or the channels (the
names of other nodes and jobs) and admin commands (ACL, CONFIG, CLIENT KILL, ...)."""
_NO_FUNCTIONS = ["-function"]
"""Nor functions, whose libraries every user shares: Redis 7 and later (Redis 6, as `make demo`'s
embedded one, has none, and refuses a rule that names them)."""
JOB_COMMANDS = ["-@all", "+@read", "+@write", "+@scripting", "+@transaction", "+@connection", *_NO_LISTING]
NODE_COMMANDS = ["-@all", "+@read", "+@connection", "+time", *_NO_LISTING]
"""An agent reads its stream (XREAD, XREVRANGE) and Redis's clock (to place its first read): read
commands only, so its keys' pattern needs no read-only selector (Redis 7's %R~)."""


@cache
def _denied_functions() -> list[str]:
    """_NO_FUNCTIONS where the portal's Redis has functions. Raises redis.RedisError."""
    version = str(client().info("server")["redis_version"])
    return _NO_FUNCTIONS if int(version.split(".")[0]) >= 7 else []


def _glob_literal(text: str) -> str:
    """`text` as a literal in a Redis ACL glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def job_username(job_id: int) -> str:
    return coordination_key(job_id, settings.BUNGEE.redis_prefix)


def node_username(node_name: str) -> str:
    """The user of node `node_name`, named as its keys are: its command stream is
    `<name>:commands` (elastic.wire.command_stream)."""
    return command_stream(node_name, settings.BUNGEE.redis_prefix).removesuffix(":commands")


def _url_for(username: str, password: str) -> str:
    """The portal's Redis URL with `username` and `password` in place of its own credentials."""
    parts = urlsplit(settings.REDIS_URL)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"))


def _job_password(username: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), f"redis-user:{username}".encode(), hashlib.sha256).hexdigest()


# Each user is made from scratch (reset) with no channel but those named: Redis 6's reset leaves
# a user every channel (its acl-pubsub-default), hence resetchannels too.


def _set_job_user(target: redis.Redis | redis.client.Pipeline, job_id: int) -> None:
    username = job_username(job_id)
    pattern = f"{_glob_literal(username)}:*"
    target.acl_setuser(
        username, enabled=True, reset=True, reset_channels=True, passwords=[f"+{_job_password(username)}"],
        keys=[pattern], channels=[pattern], commands=[*JOB_COMMANDS, *_denied_functions()],
    )


def _set_node_user(target: redis.Redis | redis.client.Pipeline, node_name: str, password_sha256: str) -> None:
    username = node_username(node_name)
    target.acl_setuser(
        username, enabled=True, reset=True, reset_channels=True, hashed_passwords=[f"+{password_sha256}"],
        keys=[f"{_glob_literal(username)}:*"], commands=[*NODE_COMMANDS, *_denied_functions()],
    )


def job_url(job_id: int) -> str:
    """Makes (or makes again) the user of job `job_id` and returns the Redis URL its workers
    connect with. Raises redis.RedisError if Redis does not answer."""
    _set_job_user(client(), job_id)
    username = job_username(job_id)
    return _url_for(username, _job_password(username))


def remove_job_user(job_id: int) -> None:
    """Removes the user of job `job_id` (its workers' connections are closed by Redis). Redis
    away is logged, not raised: the tick's `sync` removes a user left behind."""
    try:
        client().acl_deluser(job_username(job_id))
    except redis.RedisError as err:
        log.warning("could not remove the Redis user of job %s (the tick will): %s", job_id, err)


def new_node_user(node_name: str) -> tuple[str, str]:
    """Makes the user of node `node_name` with a fresh random password (an earlier password stops
    working, and the connections made with it are closed). Returns the Redis URL the node's agent
    connects with and the password's SHA-256, for the database. Raises redis.RedisError."""
    password = secrets.token_urlsafe(32)
    password_sha256 = hashlib.sha256(password.encode()).hexdigest()
    username = node_username(node_name)
    with client().pipeline(transaction=True) as pipe:
        _set_node_user(pipe, node_name, password_sha256)
        pipe.client_kill_filter(user=username, skipme=True)
        pipe.execute()
    return _url_for(username, password), password_sha256


def sync(jobs: Iterable[int], nodes: Mapping[str, str]) -> None:
    """Makes the user of every job in `jobs` (those whose workers may run) and of every node in
    `nodes` (name -> password SHA-256) again, and removes the users of this deployment's jobs and
    nodes that are not among them: two round trips (the users listed, then one pipeline). Raises
    redis.RedisError if Redis does not answer."""
    jobs = list(jobs)
    redis_client = client()
    keep = {job_username(job_id) for job_id in jobs} | {node_username(name) for name in nodes}
    prefixes = (f"{settings.BUNGEE.redis_prefix}:job:", f"{settings.BUNGEE.redis_prefix}:node:")
    users = [str(name) for name in redis_client.acl_users()]  # text: the portal's client decodes replies
    stale = [name for name in users if name.startswith(prefixes) and name not in keep]
    with redis_client.pipeline(transaction=False) as pipe:
        for job_id in jobs:
            _set_job_user(pipe, job_id)
        for name, password_sha256 in nodes.items():
            _set_node_user(pipe, name, password_sha256)
        if stale:
            pipe.acl_deluser(*stale)
        pipe.execute()
