"""A write to a user endpoint without a user's credentials is refused for what it lacks, not for
CSRF: anonymous (or with an unknown token) 401, with a valid token of another role 403 naming the
role. A signed-in session still needs its CSRF token (tests/test_api_permissions.py)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

WRITES = ["/api/jobs", "/api/jobs/validate", "/api/jobs/1/resize", "/api/jobs/1/cancel", "/api/nodes/node-a/drain"]


def post(path: str, token: str | None) -> dict:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    browser = Client(enforce_csrf_checks=True)  # as a browser's request is checked
    reply = browser.post(path, json.dumps(VALID_SPEC), content_type="application/json", **headers)
    return {"status": reply.status_code, **reply.json()["error"]}


@pytest.mark.parametrize("path", WRITES)
def test_anonymous_and_unknown_tokens_get_401(path: str) -> None:
    for token in (None, "bng_not-a-token"):
        error = post(path, token)
        assert (error["status"], error["code"]) == (401, "unauthenticated"), (path, token, error)
        assert "CSRF" not in error["message"]


@pytest.mark.parametrize("path", WRITES)
def test_an_agent_token_gets_403_naming_its_role(tokens: dict, path: str) -> None:
    error = post(path, tokens["agent"])
    assert (error["status"], error["code"]) == (403, "forbidden"), (path, error)
    assert "this token's role is 'agent'" in error["message"] and "CSRF" not in error["message"]
