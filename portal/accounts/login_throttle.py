"""Password guessing, on every path that checks a password (django.contrib.auth.authenticate: the
login page, the admin's). A *user* is locked by django-axes after BUNGEE_LOGIN_FAILURE_LIMIT
failed logins, from any address, for BUNGEE_LOGIN_COOLOFF_MIN minutes (settings). An *address*
is only throttled here, never locked out: one whose logins failed BUNGEE_LOGIN_ADDRESS_FAILURES
times within BUNGEE_LOGIN_ADDRESS_WINDOW_S is answered 429 with Retry-After until that window
ends, its password unchecked and counted against no user. Behind a proxy or a NAT many people
share an address; a lockout by address let one of them lock out all the others.

The client's address is REMOTE_ADDR and nothing else. The ASGI server puts the real client there,
taking a proxy's X-Forwarded-For only from the proxies it trusts (BUNGEE_FORWARDED_ALLOW_IPS); a
header the client sends itself never chooses the address it is counted under.

The counts live in Redis, which is transport: with Redis away the throttle lets logins through
and says so in the log, and the users' locks, in the database, still hold."""

from __future__ import annotations

import ipaddress
import logging
import math
from typing import Any

import redis
from axes.handlers.database import AxesDatabaseHandler
from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.deprecation import MiddlewareMixin

from portal.redis import client, key

log = logging.getLogger(__name__)

RETRY_AFTER_ATTRIBUTE = "login_retry_after_s"
"""Set on a request whose login the throttle refused: the seconds its address must wait."""


def client_address(request: HttpRequest) -> str | None:
    """The client's address as the ASGI server gives it (REMOTE_ADDR), never from a header;
    None where it gives none (a Unix socket with no proxy in front, a request made in code)."""
    return request.META.get("REMOTE_ADDR") or None


def address_group(address: str | None) -> str:
    """What an address is counted under: itself, except that an IPv6 address counts as its /64
    (one host is given a whole /64 and may send from any address in it) and an IPv4 address
    written as IPv6 (::ffff:203.0.113.7, from a dual-stack socket) as the IPv4 address. Requests
    with no address are counted together, as "unknown"."""
    if address is None:
        return "unknown"
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


def _counter(request: HttpRequest) -> str:
    return key("login-failures", address_group(client_address(request)))


def retry_after_s(request: HttpRequest) -> int | None:
    """Seconds until the request's address may try a password again, or None if it may now
    (and if Redis does not answer)."""
    counter = _counter(request)
    try:
        with client().pipeline(transaction=True) as pipe:
            pipe.get(counter)
            pipe.pttl(counter)
            failures, left_ms = pipe.execute()
    except redis.RedisError as err:
        log.warning("login throttle: Redis is not answering, the address %s is not checked: %s",
                    client_address(request), err)
        return None
    if failures is None or int(failures) < settings.BUNGEE.login_address_failures or left_ms <= 0:
        return None
    return max(1, math.ceil(left_ms / 1000))


def count_failure(request: HttpRequest) -> None:
    """Count a failed login against the request's address. The first failure opens a window of
    BUNGEE_LOGIN_ADDRESS_WINDOW_S; later ones do not extend it."""
    counter = _counter(request)
    try:
        with client().pipeline(transaction=True) as pipe:
            pipe.set(counter, 0, ex=settings.BUNGEE.login_address_window_s, nx=True)
            pipe.incr(counter)
            pipe.execute()
    except redis.RedisError as err:
        log.warning("login throttle: Redis is not answering, a failed login from %s is not counted: %s",
                    client_address(request), err)


def _refused_by_throttle(request: HttpRequest | None) -> bool:
    return request is not None and getattr(request, RETRY_AFTER_ATTRIBUTE, None) is not None


class LoginThrottleBackend:
    """The first authentication backend: a login from a throttled address stops here, before
    any password is checked or any user's lock is looked up."""

    def authenticate(self, request: HttpRequest | None, **credentials: Any) -> None:
        """None (the next backend decides) unless the address is throttled. Raises
        PermissionDenied then, which ends authenticate() with a failed login, after marking the
        request for ThrottledLoginResponse."""
        if request is None:
            return None
        wait_s = retry_after_s(request)
        if wait_s is None:
            return None
        setattr(request, RETRY_AFTER_ATTRIBUTE, wait_s)
        raise PermissionDenied(f"logins from {client_address(request)} are throttled for {wait_s} s")


def count_failed_login(sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None,
                       **_: Any) -> None:
    """user_login_failed: every failure counts against its address (a wrong password, a locked
    user), except the throttle's own refusals, where no password was tried."""
    if request is not None and not _refused_by_throttle(request):
        count_failure(request)


class AxesHandler(AxesDatabaseHandler):
    """django-axes' database handler, except that a login the throttle refused counts against
    no user: its password was never checked, and the user may be someone else behind the same
    address."""

    def user_login_failed(self, sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None,
                          **kwargs: Any) -> None:
        if _refused_by_throttle(request):
            return
        super().user_login_failed(sender, credentials, request, **kwargs)


class ThrottledLoginResponse(MiddlewareMixin):
    """A login the throttle refused is answered 429 with Retry-After and a page that says why,
    whichever view asked for it (the login page re-rendered its form with an error)."""

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        wait_s = getattr(request, RETRY_AFTER_ATTRIBUTE, None)
        if wait_s is None:
            return response
        context = {"retry_after_s": wait_s, "address": client_address(request)}
        throttled = render(request, "login_throttled.html", context, status=429)
        throttled["Retry-After"] = str(wait_s)
        return throttled
