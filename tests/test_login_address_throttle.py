"""An address whose logins fail faster than a rate is throttled, not locked out: past
BUNGEE_LOGIN_ADDRESS_FAILURES failures within BUNGEE_LOGIN_ADDRESS_WINDOW_S, every login from it,
on the login page or the admin's, is answered 429 with Retry-After until the window ends, its
password unchecked and counted against no user; then it logs in again. Other addresses are not
touched, and with Redis away logins go on."""

from __future__ import annotations

import time
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.test import Client

from portal import redis as portal_redis

pytestmark = pytest.mark.django_db

ADDRESS = "203.0.113.7"
FAILURES = 3
WINDOW_S = 4


def log_in(username: str, password: str, address: str, path: str = "/login/") -> Any:
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


@pytest.fixture
def throttle(settings: Any, redis_client: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(
        update={"login_address_failures": FAILURES, "login_address_window_s": WINDOW_S}
    )


def test_an_address_past_the_rate_waits_out_the_window_then_logs_in(users: dict, throttle: None) -> None:
    for username in ("alice", "bob", "nobody"):
        wrong = log_in(username, "guess", ADDRESS)
        assert wrong.status_code == 200 and b"didn't match" in wrong.content
    throttled = log_in("bob", "bob-pass", ADDRESS)
    assert throttled.status_code == 429
    retry_after_s = int(throttled["Retry-After"])
    assert 1 <= retry_after_s <= WINDOW_S, "a short wait, not a lockout"
    assert "Too many failed logins from your address" in throttled.content.decode()
    assert f"try again in\n{retry_after_s} second" in throttled.content.decode()
    admin = log_in("root", "root-pass", ADDRESS, "/admin/login/")
    assert admin.status_code == 429 and admin["Retry-After"], "the admin's login is throttled too"
    assert log_in("bob", "bob-pass", "198.51.100.2").status_code == 302, "another address is not throttled"
    assert not AccessAttempt.objects.filter(username__in=["bob", "root"]).exists(), \
        "a throttled login counts against no user"
    assert AccessAttempt.objects.get(username="alice").failures_since_start == 1

    time.sleep(retry_after_s)  # what the reply asked for
    assert log_in("bob", "bob-pass", ADDRESS).status_code == 302, "the window is over"
    assert log_in("alice", "guess", ADDRESS).status_code == 200, "and the count starts again"


def test_with_redis_away_logins_go_on(users: dict, throttle: None, settings: Any,
                                      caplog: pytest.LogCaptureFixture) -> None:
    reachable = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    portal_redis.client.cache_clear()
    try:
        for _ in range(FAILURES + 1):
            assert log_in("alice", "guess", ADDRESS).status_code == 200
        assert log_in("bob", "bob-pass", ADDRESS).status_code == 302
        assert f"login throttle: Redis is not answering, the address {ADDRESS} is not checked" in caplog.text
    finally:
        settings.REDIS_URL = reachable
        portal_redis.client.cache_clear()
