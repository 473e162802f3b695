"""Bad input gets a 4xx in the one error shape, with the field and the offending value (cut when
long), in bounded time and memory, and nothing is stored: each case of an outside probe
(deep nesting, YAML alias bombs, NaN, NUL characters, booleans for numbers, steps past
the cap, the wrong Content-Type, Django's own 404 and 405 pages under /api/)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from portal.jobs.models import Job
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

SPEC_YAML = "name: mlp\nworkload: digits-mlp\nsteps: 50\n"


def error_of(reply: Any, status: int) -> dict[str, Any]:
    """The reply's error, after checking its status, that it is JSON (strict: no bare NaN) in
    the one shape, and small."""
    assert reply.status_code == status, reply.content[:500]
    assert reply["Content-Type"].startswith("application/json"), reply["Content-Type"]
    assert len(reply.content) < 4000, f"a {len(reply.content)}-byte error reply"
    body = json.loads(reply.content, parse_constant=lambda name: pytest.fail(f"bare {name} in the reply"))
    error = body["error"]
    assert error["status"] == status and error["code"] and error["message"]
    return error


def yaml_bomb(levels: int) -> str:
    """Each level's anchor holds ten aliases of the one below: 10**levels copies of "lol"."""
    lines = ['a0: &a0 ["lol"]']
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join(f'*a{level - 1}' for _ in range(10))}]")
    return "\n".join(lines) + f"\nname: *a{levels}\nworkload: digits-mlp\nsteps: 5\n"


def test_json_nested_100000_deep_is_refused(api: dict) -> None:
    error = error_of(api["alice"].post("/api/jobs", "[" * 100_000 + "]" * 100_000), 400)
    assert error["code"] == "malformed_body" and "nested deeper than 32" in error["message"]
    error = error_of(api["alice"].post("/api/jobs", json.dumps({**VALID_SPEC, "name": [[[[[[[]]]]]]] * 1})
                                       .replace("[[[[[[[]]]]]]]", "[" * 500 + "]" * 500)), 400)
    assert "nested deeper" in error["message"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("depth", [1_000, 5_000])
def test_yaml_nested_deep_is_refused(api: dict, depth: int) -> None:
    body = SPEC_YAML + "hyperparameters: " + "[" * depth + "]" * depth + "\n"
    error = error_of(api["alice"].post("/api/jobs", body, content_type="application/yaml"), 400)
    assert "nested deeper than 32" in error["message"]


@pytest.mark.parametrize("levels", [4, 6, 9])
def test_a_yaml_alias_bomb_is_refused_without_expanding(api: dict, levels: int) -> None:
    body = yaml_bomb(levels)
    assert len(body) < 600
    error = error_of(api["alice"].post("/api/jobs", body, content_type="application/yaml"), 400)
    assert "aliases (*name) are not accepted" in error["message"]
    assert not Job.objects.exists()


def test_yaml_tags_that_build_objects_are_refused(api: dict) -> None:
    body = SPEC_YAML + "hyperparameters: !!python/object/apply:os.system ['true']\n"
    error = error_of(api["alice"].post("/api/jobs", body, content_type="application/yaml"), 400)
    assert "python/object/apply" in error["message"]


def test_nan_and_infinity_are_refused_and_never_echoed_bare(api: dict) -> None:
    for text in ('{"name": "x", "workload": "digits-mlp", "steps": 5, "hyperparameters": {"lr": NaN}}',
                 '{"name": "x", "workload": "digits-mlp", "steps": Infinity}'):
        error = error_of(api["alice"].post("/api/jobs", text), 400)
        assert "is not a JSON number" in error["message"]
    error = error_of(api["alice"].post("/api/jobs", SPEC_YAML + "hyperparameters: {lr: .nan}\n",
                                       content_type="application/yaml"), 400)
    assert "not a finite number" in error["message"]


def test_a_nul_character_is_refused_where_it_is(api: dict) -> None:
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, "name": "a\u0000b"}), 400)
    assert error["fields"][0]["field"] == "name" and "NUL" in error["fields"][0]["message"]
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, "hyperparameters": {"x\u0000": 1}}), 400)
    assert error["fields"][0]["field"] == "hyperparameters"
    error = error_of(api["alice"].get("/api/jobs", owner="\u0000"), 400)
    assert error["fields"][0]["field"] == "owner"
    assert not Job.objects.exists()


def test_a_boolean_is_no_number(api: dict) -> None:
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, "steps": True}), 400)
    assert error["fields"] == [{"field": "steps", "message": "true is not a valid value here", "value": True}]


def test_epochs_that_come_to_more_steps_than_the_cap_are_refused(api: dict) -> None:
    spec = {"name": "big", "workload": "char-transformer", "epochs": 67000, "hyperparameters": {"batch_size": 1}}
    error = error_of(api["alice"].post("/api/jobs", spec), 400)
    [field] = error["fields"]
    assert field["field"] == "epochs" and "at most 10,000,000 steps" in field["message"], field
    assert not Job.objects.exists()


def test_only_json_or_yaml_is_a_spec(api: dict) -> None:
    error = error_of(api["alice"].post("/api/jobs", json.dumps(VALID_SPEC), content_type="text/plain"), 415)
    assert error["fields"][0] == {"field": "Content-Type", "message": "application/json or application/yaml",
                                  "value": "text/plain"}


def test_a_long_value_is_echoed_cut(api: dict) -> None:
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, "name": "n" * 100_000}), 400)
    [field] = error["fields"]
    assert field["field"] == "name" and len(field["value"]) < 300 and field["value"].startswith("nnn")
    error = error_of(api["alice"].post("/api/jobs", {**VALID_SPEC, "min_workers": list(range(20_000))}), 400)
    assert len(error["fields"][0]["value"]) < 300


def test_djangos_own_error_pages_under_api_have_the_shape(api: dict) -> None:
    error = error_of(api["alice"].get("/api/jobs/abc"), 404)
    assert error["code"] == "not_found" and "/api/jobs/abc" in error["message"]
    reply = api["alice"].get("/api/jobs/1/resize")
    error = error_of(reply, 405)
    assert error["code"] == "method_not_allowed" and "POST" in reply["Allow"]


def test_resize_errors_match_submits(api: dict) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    error = error_of(api["alice"].post(f"/api/jobs/{job_id}/resize", "{not json"), 400)
    assert error["code"] == "malformed_body"
    error = error_of(api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": "two"}), 400)
    assert error["fields"][0]["field"] == "workers" and error["fields"][0]["value"] == "two"


# --- the agents' side --------------------------------------------------------------------------


def post_report(tokens: dict, text: str) -> Any:
    from django.test import Client

    return Client().post("/api/agent/report", text, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {tokens['agent']}")


def test_a_report_stores_what_is_valid_and_refuses_the_rest_item_by_item(
    api: dict, tokens: dict, cluster: Any
) -> None:
    from portal.accounts.models import ApiToken
    from portal.cluster.models import Node
    from portal.jobs.models import JobLog
    from portal.scheduling.cycle import run_cycle

    Node.objects.filter(pk=cluster.pk).update(agent_token=ApiToken.lookup(tokens["agent"]))
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    run_cycle()  # its rank 0 goes to node-a, which may then speak for it
    now = 1.7e9
    sample = {"index": 0, "taken_at": now, "utilization_pct": 50.0, "memory_used_bytes": 1,
              "memory_total_bytes": 2}
    text = json.dumps({
        "node": "node-a",
        "samples": [{**sample, "utilization_pct": "NAN_HERE"}, {**sample, "taken_at": 1e300}, sample],
        "events": [
            {"job_id": job_id, "generation": 1, "rank": 0, "kind": "log", "at": "NAN_HERE", "message": "bad"},
            {"job_id": job_id, "generation": 1, "rank": 0, "kind": "log", "at": now, "message": "kept"},
        ],
    }).replace('"NAN_HERE"', "NaN")
    reply = post_report(tokens, text)
    assert reply.status_code == 200, reply.content
    refused = reply.json()["refused"]
    assert [item["item"] for item in refused] == ["samples[0]", "samples[1]", "events[0]"], refused
    assert "finite" in refused[0]["message"] and refused[0]["value"] == "nan"
    assert "less than or equal to 4100000000" in refused[1]["message"]
    assert [line for line in JobLog.objects.filter(job_id=job_id).values_list("line", flat=True) if "kept" in line or "bad" in line] == ["kept"]
    cluster_reply = api["alice"].get("/api/cluster")
    json.loads(cluster_reply.content, parse_constant=lambda name: pytest.fail(f"bare {name} in /api/cluster"))


# --- secrets ---------------------------------------------------------------------------------


def test_a_public_secret_key_stops_the_portal_with_debug_off(settings: Any, tmp_path: Any) -> None:
    from django.core import checks

    from portal.secrets_check import DEVELOPMENT_SECRET_KEY, secret_key_file, secret_key_problem

    for key in (DEVELOPMENT_SECRET_KEY, "change-me", "short"):
        settings.SECRET_KEY, settings.DEBUG = key, False
        errors = [m for m in checks.run_checks(tags=[checks.Tags.security]) if m.id == "bungee.E002"]
        assert errors and "SECRET_KEY" in errors[0].msg, key
    assert secret_key_problem(DEVELOPMENT_SECRET_KEY, debug=True) is None
    made = secret_key_file(tmp_path)
    assert len(made) >= 50 and secret_key_file(tmp_path) == made, "made once, then kept"
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
    assert secret_key_problem(made, debug=False) is None


def test_the_asgi_portal_will_not_start_on_the_development_key() -> None:
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("SECRET_KEY", "DEBUG")}
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    started = subprocess.run([sys.executable, "-c", "import portal.asgi"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode != 0 and "SECRET_KEY is 'bungee-development-key-change-me-in-production'" in started.stderr


def test_bounds_in_the_openapi_document_are_enforced_with_the_value(api: dict) -> None:
    error = error_of(api["alice"].get("/api/cluster/history", minutes=5000), 400)
    assert error["fields"] == [{"field": "minutes", "message": "Input should be less than or equal to 1440",
                                "value": "5000"}], error
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    error = error_of(api["alice"].post(f"/api/jobs/{job_id}/resize", {"workers": 0}), 400)
    assert error["fields"][0]["field"] == "workers" and error["fields"][0]["value"] == 0
