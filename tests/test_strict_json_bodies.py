"""The user API reads JSON strictly: `true` is no integer (a resize's workers) and no number of
seconds (a drain's deadline_s), NaN and Infinity are no finite number, and a body of `null` or
`[]` is no object (ninja took either as "use the defaults")."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.django_db


def error_of(reply: Any) -> dict:
    assert reply.status_code == 400, reply.content
    return dict(reply.json()["error"])


@pytest.fixture
def alices_job(api: dict) -> int:
    from tests.conftest import VALID_SPEC

    return int(api["alice"].post("/api/jobs", VALID_SPEC).json()["id"])


def test_true_is_no_integer(api: dict, alices_job: int, cluster: Any) -> None:
    error = error_of(api["alice"].post(f"/api/jobs/{alices_job}/resize", {"workers": True}))
    assert error["fields"][0]["field"] == "workers" and error["fields"][0]["value"] is True
    error = error_of(api["staff"].post("/api/nodes/node-a/drain", {"deadline_s": True}))
    assert error["fields"][0]["field"] == "deadline_s"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_no_finite_number(api: dict, cluster: Any, number: str) -> None:
    error = error_of(api["staff"].post("/api/nodes/node-a/drain", f'{{"deadline_s": {number}}}'))
    assert "finite number" in error["message"] and "86400" not in error["message"], error


@pytest.mark.parametrize("body", ["null", "[]", "3", '"text"'])
def test_a_body_that_is_no_object_is_refused(api: dict, alices_job: int, cluster: Any, body: str) -> None:
    for client, path in ((api["alice"], f"/api/jobs/{alices_job}/resize"), (api["staff"], "/api/nodes/node-a/drain")):
        error = error_of(client.post(path, body))
        assert error["code"] == "malformed_body" and "the body must be a JSON object" in error["message"], error
