"""The address a login is counted under is REMOTE_ADDR, what the ASGI server gives (behind a
proxy it trusts, the client's address taken from the proxy's X-Forwarded-For). A header the
client sends itself (X-Forwarded-For, X-Real-IP, Forwarded) neither frees a throttled address
nor throttles another one, and django-axes records the same address. An IPv6 host is counted
by its /64, an IPv4 client on a dual-stack socket by its IPv4 address."""

from __future__ import annotations

from typing import Any

import pytest
from axes.models import AccessAttempt
from django.test import Client

from portal.accounts.login_throttle import address_group

pytestmark = pytest.mark.django_db

ADDRESS = "203.0.113.7"
OTHER = "198.51.100.2"
FAILURES = 3
CLAIMS = {"HTTP_X_FORWARDED_FOR": OTHER, "HTTP_X_REAL_IP": OTHER, "HTTP_FORWARDED": f"for={OTHER}"}


def log_in(username: str, password: str, address: str, **headers: str) -> Any:
    return Client(REMOTE_ADDR=address).post("/login/", {"username": username, "password": password}, **headers)


@pytest.fixture
def throttle(settings: Any, redis_client: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(
        update={"login_address_failures": FAILURES, "login_address_window_s": 60}
    )


def test_headers_the_client_sends_do_not_change_its_address(users: dict, throttle: None) -> None:
    for _ in range(FAILURES):
        assert log_in("alice", "guess", ADDRESS, **CLAIMS).status_code == 200
    assert {a.ip_address for a in AccessAttempt.objects.all()} == {ADDRESS}
    assert log_in("bob", "bob-pass", ADDRESS, **CLAIMS).status_code == 429, "claiming another address frees nothing"
    spoofed = {name: ADDRESS if name != "HTTP_FORWARDED" else f"for={ADDRESS}" for name in CLAIMS}
    assert log_in("bob", "bob-pass", OTHER, **spoofed).status_code == 302, "claiming a throttled address costs nothing"


@pytest.mark.parametrize(
    "address,group",
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:a:b:c:d", "2001:db8:1:2::/64"),
        ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("::ffff:203.0.113.7", "203.0.113.7"),
        (None, "unknown"),
    ],
)
def test_what_an_address_is_counted_under(address: str | None, group: str) -> None:
    assert address_group(address) == group


def test_an_ipv6_host_cannot_step_around_the_throttle_in_its_64(users: dict, throttle: None) -> None:
    for host in range(1, FAILURES + 1):
        assert log_in("alice", "guess", f"2001:db8:1:2::{host}").status_code == 200
    assert log_in("bob", "bob-pass", "2001:db8:1:2::ffff").status_code == 429
    assert log_in("bob", "bob-pass", "2001:db8:1:3::1").status_code == 302
