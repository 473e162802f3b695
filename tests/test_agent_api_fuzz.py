"""Every agent operation of the OpenAPI document (`/api/agent/...`), fuzzed by schemathesis in the
portal's own process (WSGI) with the agent token of node-a, where a job of alice's runs: no reply
is a 5xx, and every reply is what the document says. Half the cases speak for node-a and that job
(a report's node, a path's job_id), so that the fuzzing reaches past the token and ownership
checks into what the endpoints do with a body. Bounded: EXAMPLES cases an operation; the count is
printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, settings
from schemathesis import checks

from portal.jobs.models import Job
from tests import test_artifacts_api
from tests.test_api_fuzz import connection_kept

EXAMPLES = 25
REQUESTS: list[int] = []

ran_here = test_artifacts_api.ran_here
"""Alice's job, whose rank 0 started on node-a, which tokens["agent"] serves."""

schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application()).include(
    path_regex="^/api/agent/"
)


@pytest.fixture
def artifact_dir(settings: Any, tmp_path: Path) -> Path:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    return tmp_path / "artifacts"


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_agent_operation_fails_or_breaks_its_schema(
    case: Any, tokens: dict, ran_here: Job, artifact_dir: Path
) -> None:
    # Left out, as in tests/test_api_fuzz.py: positive_data_acceptance (a schema-valid body may
    # still be refused by rules across fields) and ignored_auth (tests/test_api_permissions).
    excluded = [checks.positive_data_acceptance, checks.ignored_auth]
    if len(REQUESTS) % 2 == 0:
        if isinstance(case.body, dict) and "node" in case.body:
            case.body["node"] = "node-a"
        if case.path_parameters and "job_id" in case.path_parameters:
            case.path_parameters["job_id"] = ran_here.pk
        # What schemathesis generated wrong on purpose may have been put right just now.
        excluded.append(checks.negative_data_rejection)
    with connection_kept():
        response = case.call(headers={"Authorization": f"Bearer {tokens['agent']}"})
    REQUESTS.append(response.status_code)
    assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
    case.validate_response(response, excluded_checks=excluded)


def test_print_the_request_count() -> None:
    """Runs after the fuzzing (file order): says how many requests it made."""
    print(f"\nagent API fuzz: {len(REQUESTS)} requests, {sum(1 for s in REQUESTS if s >= 500)} server errors, "
          f"{sum(1 for s in REQUESTS if 400 <= s < 500)} refused (4xx)")
    assert REQUESTS and all(status < 500 for status in REQUESTS)
