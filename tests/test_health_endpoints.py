"""The portal's probes (portal.health): /healthz answers without the database or Redis, /readyz
answers once both have, and neither asks who is calling."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client


def test_liveness_answers_without_touching_the_database() -> None:
    """No `db` fixture: pytest-django fails any database access in this test, so a /healthz that
    queried would answer 500 (or raise) here."""
    reply = Client().get("/healthz")
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readiness_answers_when_the_database_and_redis_do(redis_client: Any) -> None:
    reply = Client().get("/readyz")
    assert reply.status_code == 200, reply.content
    assert reply.json() == {"status": "ready"}


@pytest.mark.django_db
def test_the_probes_need_no_login_and_take_only_get_and_head(redis_client: Any) -> None:
    for path in ("/healthz", "/readyz"):
        assert Client().head(path).status_code == 200
        assert Client().post(path).status_code == 405
