"""Test settings: the real PostgreSQL and Redis of this machine (TEST_DATABASE_URL and
TEST_REDIS_URL override them), under a prefix of their own."""

import os
import secrets

import dj_database_url

from portal.live.redis_connection import layer_host
from portal.settings import *  # noqa: F403
from portal.settings import BUNGEE, CHANNEL_LAYER_TIMEOUTS

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bungee")
    )
}
# One test database per test run, so that two runs on one machine do not drop each other's.
DATABASES["default"]["TEST"] = {"NAME": f"test_bungee_{os.getpid()}"}
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [layer_host(REDIS_URL, **CHANNEL_LAYER_TIMEOUTS)], "prefix": f"bungee-test-{os.getpid()}",
                   "group_expiry": 120},
    }
}
CELERY_BROKER_URL = REDIS_URL
# Tasks that a unit test triggers run in the test process itself.
CELERY_TASK_ALWAYS_EAGER = True
BUNGEE = BUNGEE.model_copy(update={"redis_prefix": f"bungee-test-{os.getpid()}"})
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# A random key per run: the development default is refused with DEBUG off (portal.secrets_check).
SECRET_KEY = secrets.token_urlsafe(50)
