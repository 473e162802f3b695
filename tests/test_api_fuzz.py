"""Every operation of the OpenAPI document, fuzzed by schemathesis in the portal's own process
(WSGI), as the owner of a job and as another user: no reply is a 5xx, and every reply is what
the document says (status, content type, body schema). Bounded: EXAMPLES cases an operation, a
request each for both users; the count is printed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis import checks

from tests.conftest import VALID_SPEC

EXAMPLES = 15
REQUESTS: list[int] = []


@contextmanager
def connection_kept() -> Iterator[None]:
    """As Django's test client does: a request must not close the test's database connection.
    (The test client itself connects the closing again after each of its requests.)"""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


# The document needs no database: it is read once, at collection.
schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())


@pytest.fixture
def alices_job(api: dict) -> int:
    return int(api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])


# The user is a pytest parameter (not a loop in the test): each operation's test then has a node
# id of its own, `...[POST /api/jobs][alice]` (with none, schemathesis leaves all the operations
# one id, and pytest-xdist's --dist loadfile, which schedules by id, would run one of them).
@schema.parametrize()
@pytest.mark.parametrize("user", ["alice", "bob"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_operation_fails_or_breaks_its_schema(case: Any, user: str, tokens: dict, alices_job: int) -> None:
    with connection_kept():
        response = case.call(headers={"Authorization": f"Bearer {tokens[user]}"})
    REQUESTS.append(response.status_code)
    assert response.status_code < 500, (case.method, case.formatted_path, response.text[:500])
    # Left out: positive_data_acceptance, since a schema-valid spec may still be refused (rules
    # across fields: exactly one of steps and epochs, min_workers <= max_workers, the steps cap
    # are the API's own, not the document's); ignored_auth, which replays the case with made-up
    # credentials but keeps the token passed here (tests/test_api_permissions checks refusals).
    # Every other check stands: status, content type, headers, body schema.
    case.validate_response(response, excluded_checks=[checks.positive_data_acceptance, checks.ignored_auth])


def test_print_the_request_count() -> None:
    """Runs after the fuzzing (file order): says how many requests it made, and that some were
    refused and some taken."""
    print(f"\nAPI fuzz: {len(REQUESTS)} requests, {sum(1 for s in REQUESTS if s >= 500)} server errors, "
          f"{sum(1 for s in REQUESTS if 400 <= s < 500)} refused (4xx)")
    assert REQUESTS and all(status < 500 for status in REQUESTS)
