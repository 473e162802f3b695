"""The portal refuses to run with DEBUG off on a secret key anyone can read: the development
default in settings.py, docker-compose's old `change-me`, or one too short to be random. A
system check (manage.py check, migrate, ...) reports it as an error naming SECRET_KEY, and the
ASGI application (portal.asgi) will not start on it. `make demo` makes a random key once and
keeps it under its data directory (`secret_key_file`)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core import checks

DEVELOPMENT_SECRET_KEY = "bungee-development-key-change-me-in-production"
PUBLIC_KEYS = frozenset({DEVELOPMENT_SECRET_KEY, "change-me", "changeme", "secret"})
MIN_LENGTH = 32


def secret_key_problem(secret_key: str, debug: bool) -> str | None:
    """Why `secret_key` may not be used (None if it may, or if `debug`)."""
    if debug:
        return None
    if secret_key in PUBLIC_KEYS:
        return (
            f"SECRET_KEY is {secret_key!r}, a value anyone can read in Bungee's sources; set the SECRET_KEY "
            "environment variable to a random value, e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    if len(secret_key) < MIN_LENGTH:
        return f"SECRET_KEY is {len(secret_key)} characters long; use a random value of at least {MIN_LENGTH}"
    return None


def check_secret_key(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    problem = secret_key_problem(settings.SECRET_KEY, settings.DEBUG)
    return [checks.Error(problem, id="bungee.E002")] if problem else []


def secret_key_file(data_dir: Path) -> str:
    """The secret key kept in `data_dir`/secret_key (readable by its owner only), made at
    random the first time."""
    path = data_dir / "secret_key"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(secrets.token_urlsafe(50))
    return path.read_text().strip()
