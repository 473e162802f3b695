"""The portal's one Redis client (transport only: nothing here is the source of truth)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

CONNECT_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 2.0
RETRIES = 2
"""A command that finds Redis away is tried again RETRIES times, with exponential backoff
(redis-py's own Retry), then fails: every request that needs Redis ends in bounded time (the API
answers 503 then, portal.error_pages), and the next one connects again."""


@cache
def client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL,
        decode_responses=True,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def key(*parts: object) -> str:
    """A Redis key under this deployment's prefix."""
    return ":".join([settings.BUNGEE.redis_prefix, *(str(p) for p in parts)])
