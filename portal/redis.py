"""The portal's one Redis client (transport only: nothing here is the source of truth)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def key(*parts: object) -> str:
    """A Redis key under this deployment's prefix."""
    return ":".join([settings.BUNGEE["REDIS_PREFIX"], *(str(p) for p in parts)])
