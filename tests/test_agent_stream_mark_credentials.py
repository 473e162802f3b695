"""An agent that registers again gets its node's Redis user with a new password (portal.redis_users):
the position in its command stream it read before registering, with the old password, still
holds for the URL with the new one (the same Redis and stream), so it reads on right after the
last command it had seen, not from a point in time worked out from clocks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from agent.commands import COMMAND_FIELD, StreamMark, redis_location

ADMIN_URL = "redis://127.0.0.1:6379/15"


@pytest.fixture
def node_user() -> Iterator[tuple[str, str, str]]:
    """A stream with one old entry, and a user that reads it: (stream, its name, its password)."""
    admin = redis.Redis.from_url(ADMIN_URL, decode_responses=True)
    name = f"agent-test-{uuid.uuid4().hex[:8]}"
    stream = f"{name}:node:n:commands"
    admin.xadd(stream, {COMMAND_FIELD: "old"})
    admin.acl_setuser(name, enabled=True, reset=True, passwords=["+first"], keys=[f"%R~{name}:*"],
                      commands=["-@all", "+@read", "+@connection", "+time"])
    yield stream, name, "first"
    admin.delete(stream)
    admin.acl_deluser(name)
    admin.close()


def test_the_position_holds_across_a_new_password(node_user: tuple[str, str, str]) -> None:
    stream, user, password = node_user
    old_url = f"redis://{user}:{password}@127.0.0.1:6379/15"
    mark = StreamMark.take(old_url, stream)
    assert mark.last_id is not None
    admin = redis.Redis.from_url(ADMIN_URL, decode_responses=True)
    # While the agent registers: a command arrives within the clock margin, and the portal sets a
    # new password.
    time.sleep(0.01)
    arrived = admin.xadd(stream, {COMMAND_FIELD: "new"})
    admin.acl_setuser(user, enabled=True, passwords=["+second"], reset_passwords=True)
    new_url = f"redis://{user}:second@127.0.0.1:6379/15"
    with redis.Redis.from_url(new_url, decode_responses=True) as client:
        start = mark.start_id(client, new_url, stream)
        assert start == mark.last_id
        assert [entry_id for entry_id, _ in client.xrange(stream, min=f"({start}")] == [arrived]
    admin.close()


def test_the_location_leaves_the_credentials_out() -> None:
    assert redis_location("redis://bungee%3Anode%3Aa:s3cret@redis:6379/0") == "redis://redis:6379/0"
    assert redis_location("rediss://:pw@h:6380/2") == "rediss://h:6380/2"
    assert redis_location(None) is None
