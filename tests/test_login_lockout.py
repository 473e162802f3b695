"""A user, not an address, is locked after repeated failed logins (django-axes, settings): the
failures for one user from one address lock no other user out of it (behind a proxy or a NAT
everyone shares one), the limit counts a user's failures from every address, tries during the
lock do not prolong it, and the page tells the user how it ends."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.core.management import call_command
from django.test import Client

pytestmark = pytest.mark.django_db

PROXY = "203.0.113.7"
"""The one address everyone behind the site's proxy or NAT has."""


def log_in(username: str, password: str, address: str) -> Any:
    return Client(REMOTE_ADDR=address).post("/login/", {"username": username, "password": password})


def fail(username: str, address: str) -> None:
    wrong = log_in(username, "guess", address)
    assert wrong.status_code == 200 and b"didn't match" in wrong.content, wrong.status_code


def fail_until_locked(username: str, addresses: list[str]) -> None:
    """A wrong password for `username` from each address in turn: the last one, the limit's,
    is answered with the lock."""
    assert len(addresses) == settings.AXES_FAILURE_LIMIT
    for address in addresses[:-1]:
        fail(username, address)
    assert log_in(username, "guess", addresses[-1]).status_code == 429


def test_one_users_failures_lock_no_other_user_out_of_their_address(users: dict, redis_client: Any) -> None:
    fail_until_locked("alice", [PROXY] * settings.AXES_FAILURE_LIMIT)
    assert log_in("bob", "bob-pass", PROXY).status_code == 302, "bob, behind the same address, logs in"
    assert log_in("alice", "alice-pass", PROXY).status_code == 429, "alice herself is locked"


def test_a_user_is_locked_after_the_limit_counted_over_every_address(users: dict, redis_client: Any) -> None:
    addresses = [f"198.51.100.{n}" for n in range(1, settings.AXES_FAILURE_LIMIT + 1)]
    fail_until_locked("alice", addresses)
    locked = log_in("alice", "alice-pass", "192.0.2.51")
    assert locked.status_code == 429, "the right password from an address that never failed"
    page = locked.content.decode()
    assert "Logging in as <strong>alice</strong> is paused after 5 failed attempts" in page
    assert "0:15:00" in page and "python manage.py axes_reset_username alice" in page
    assert log_in("bob", "bob-pass", addresses[0]).status_code == 302
    call_command("axes_reset_username", "alice")
    assert log_in("alice", "alice-pass", "192.0.2.51").status_code == 302, "an administrator lifted it"


def test_tries_during_a_lock_do_not_prolong_it(users: dict, redis_client: Any) -> None:
    fail_until_locked("alice", [PROXY] * settings.AXES_FAILURE_LIMIT)
    [attempt] = AccessAttempt.objects.filter(username="alice")
    locked_at = attempt.attempt_time
    for address in (PROXY, "198.51.100.9"):
        assert log_in("alice", "guess", address).status_code == 429
        assert log_in("alice", "alice-pass", address).status_code == 429
    assert [a.attempt_time for a in AccessAttempt.objects.filter(username="alice")] == [locked_at]
    # The lock's cool-off counts from locked_at: once that much time has passed, alice is let in.
    cooloff = settings.AXES_COOLOFF_TIME
    assert isinstance(cooloff, timedelta)
    AccessAttempt.objects.filter(username="alice").update(attempt_time=locked_at - cooloff)
    assert log_in("alice", "alice-pass", PROXY).status_code == 302
