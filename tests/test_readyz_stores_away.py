"""/readyz with a store that does not answer: 503 in the API's error shape with Retry-After,
naming the store but none of its details (hosts, ports), within the readiness bound when the
store hangs instead of refusing. The stores are real: Redis on a port nothing listens on or a
socket that accepts and never answers, PostgreSQL on a port nothing listens on."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from typing import Any

import pytest
from django.db import connections
from django.test import Client

from portal import health
from portal.error_pages import RETRY_AFTER_S
from portal.redis import client


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(autouse=True)
def _checks_settled() -> Iterator[None]:
    """A check still waiting on a hung store is waited on by the next /readyz (portal.health):
    each test starts and ends with none in flight, so that no test sees another's store."""
    wait(list(health._running.values()))
    yield
    wait(list(health._running.values()))


@pytest.fixture
def redis_at(settings: Any) -> Iterator[Callable[[str], None]]:
    def point(url: str) -> None:
        settings.REDIS_URL = url
        client.cache_clear()

    yield point
    client.cache_clear()


def _unavailable(reply: Any) -> str:
    assert reply.status_code == 503, reply.content
    assert reply["Retry-After"] == str(RETRY_AFTER_S)
    error = reply.json()["error"]
    assert (error["status"], error["code"], error["fields"]) == (503, "unavailable", [])
    message: str = error["message"]
    assert "127.0.0.1" not in message
    return message


@pytest.mark.django_db
def test_redis_refusing(redis_at: Callable[[str], None]) -> None:
    port = _closed_port()
    redis_at(f"redis://127.0.0.1:{port}/0")
    message = _unavailable(Client().get("/readyz"))
    assert message == "the portal's Redis is not answering"
    assert str(port) not in message


@pytest.mark.django_db
def test_redis_hanging_is_not_ready_within_the_bound(redis_at: Callable[[str], None]) -> None:
    """A server that accepts the connection and never answers: redis-py would wait for its own
    timeouts and retries (several seconds); /readyz answers at READY_TIMEOUT_S."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        redis_at(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        message = _unavailable(Client().get("/readyz"))
        assert message == f"the portal's Redis did not answer within {health.READY_TIMEOUT_S:g} s"
        # The next probe waits on the same check rather than starting a second one.
        in_flight = health._running["Redis"]
        assert not in_flight.done()
        _unavailable(Client().get("/readyz"))
        assert health._running["Redis"] is in_flight
    # Closing the socket resets the connection the check waits on: it ends now, not after
    # redis-py's timeouts and retries.
    wait([in_flight])


@pytest.mark.django_db
def test_database_refusing(redis_client: Any) -> None:
    """New connections (the check's thread makes its own) go to a port nothing listens on; this
    test's own connection, already open, is untouched, and the port is put back after."""
    database = connections.settings["default"]
    port = database["PORT"]
    database["PORT"] = str(_closed_port())
    try:
        message = _unavailable(Client().get("/readyz"))
    finally:
        database["PORT"] = port
    assert message == "the portal's database is not answering"
    assert Client().get("/readyz").status_code == 200
