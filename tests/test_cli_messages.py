"""What the `bungee` command says when the portal refuses: the real API's refusals (through
Django's test client) rendered as the CLI renders them. Each thing is said once, a value the
request did not have is not shown as None, and a wrong token is told in plain words with how to
get a new one. `bungee status` shows numbers rounded for people, never raw floats."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from bungee_cli.client import CliError, Login, Portal, describe_error
from bungee_cli.main import status_cell
from tests.conftest import ApiClient

pytestmark = pytest.mark.django_db
URL = "http://portal.example:8000"


def as_reply(reply: Any) -> httpx.Response:
    """Django's test response as the httpx response the CLI reads."""
    return httpx.Response(reply.status_code, content=reply.content, headers={"content-type": reply["Content-Type"]})


def told(reply: Any) -> str:
    """What the CLI says of the refusal `reply` (raised by the client as it checks a reply)."""
    with pytest.raises(CliError) as refused:
        Portal(Login(URL, "bng_whatever"))._checked(as_reply(reply))
    return str(refused.value)


def test_a_refusal_is_said_once_with_the_value_sent(api: dict[str, ApiClient]) -> None:
    reply = api["alice"].get("/api/jobs", state="bogus")
    assert reply.status_code == 400
    said = told(reply)
    assert said.count("Input should be") == 1, said
    assert "'bogus'" in said, "the value sent is still shown"
    assert describe_error(as_reply(reply)) == said


def test_an_absent_value_is_not_shown(api: dict[str, ApiClient]) -> None:
    """min_workers and hyperparameters.batch_size left out: the refusal names neither as None."""
    reply = api["alice"].post("/api/jobs/validate", {
        "name": "mine", "code": "0" * 64, "entrypoint": "task:Mine", "max_workers": 0, "steps": 10,
    })
    assert reply.status_code == 400
    said = told(reply)
    assert "None" not in said, said
    assert "min_workers (1)" in said and "batch_size" in said and "(value: 0)" in said


def test_a_wrong_token_is_told_plainly(api: dict[str, ApiClient]) -> None:
    reply = ApiClient("bng_not-a-token").get("/api/jobs")
    assert reply.status_code == 401
    said = told(reply)
    assert "wrong" in said and "expired" in said, said
    assert "create_token" in said and f"bungee login {URL}" in said, "it says how to get a new one"
    assert "Bearer" not in said and "HTTP 401" not in said, "no API wording"


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("last_loss", 0.002248115139082074, "0.002248"),
        ("last_loss", 2.302585092994046, "2.303"),
        ("samples_per_s", 4941.246451549995, "4,941 samples/s"),
        ("samples_per_s", 12.345678, "12.3 samples/s"),
        ("attained_service_s", 52.60761400000001, "52.6 s"),
        ("attained_service_s", 727.2, "12 min 7 s"),
        ("attained_service_s", 12_000.5, "3 h 20 min"),
        ("restarts", 0, "0"),
        ("pinned_workers", None, ""),
    ],
)
def test_status_shows_numbers_for_people(key: str, value: Any, shown: str) -> None:
    assert status_cell(key, value) == shown
