"""What a person sees when something is wrong: every error the submit form's banner
counts is shown, a rule across hyperparameters beside them; the 403 and 404 pages are the site's
own, with the reason, while the API's stay JSON; a jobs filter naming no user says so (400, never
a 500); a refusal is logged as one line, without a traceback, and a quiet live socket is not
failed with one."""

from __future__ import annotations

import logging
import re

import pytest
from django.test import Client

from portal.error_pages import OneLineRefusals
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db

FORM = {"name": "lm", "workload": "char-transformer", "min_workers": "1", "max_workers": "2",
        "length": "100", "length_kind": "steps", "seed": "0", "priority": "guaranteed", "consistency": "strict"}


def logged_in(name: str) -> Client:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.get(username=name))
    return client


def shown_errors(html: str) -> list[str]:
    """The text of every error the form shows: beside an input, or listed under the banner."""
    beside = re.findall(r'<p class="field-error" id="[^"]+">(.*?)</p>', html)
    listed = re.findall(r"<li><code>[^<]*</code>: (.*?)</li>", html)
    return beside + listed


def counted_in_banner(html: str) -> int:
    match = re.search(r'id="form-message">the job spec has (\d+) invalid fields?<', html)
    assert match, html
    return int(match.group(1))


def test_a_rule_across_hyperparameters_is_shown_beside_them(users: dict) -> None:
    page = logged_in("alice").post("/jobs/new/", {**FORM, "hp-char-transformer-d_model": "64",
                                                  "hp-char-transformer-heads": "5"})
    html = page.content.decode()
    assert page.status_code == 400
    assert counted_in_banner(html) == len(shown_errors(html)) >= 1
    assert '<p class="field-error" id="hp-char-transformer-error">d_model (64) must be a multiple of heads (5)</p>' in html
    assert 'aria-describedby="hp-char-transformer-heads-help hp-char-transformer-error"' in html


def test_every_error_the_form_can_get_is_shown(users: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each input's error beside it; one the form has no input for (a new spec field) under the
    banner."""
    from portal.jobs import views
    from portal.jobs.forms import ERROR_SLOTS

    every = {name: f"bad {name}" for name in (*ERROR_SLOTS, "hp-char-transformer-heads", "hp-char-transformer",
                                              "a_new_field") if name != "spec_yaml"}
    monkeypatch.setattr(views, "errors_by_input", lambda *args: every)
    html = logged_in("alice").post("/jobs/new/", {**FORM, "priority": "urgent"}).content.decode()
    assert sorted(shown_errors(html)) == sorted(every.values())
    assert '<ul class="field-error" id="other-errors"><li><code>a_new_field</code>: bad a_new_field</li></ul>' in html


def test_the_403_and_404_pages_are_the_sites_own_with_the_reason(api: dict) -> None:
    job_id = api["alice"].post("/api/jobs", VALID_SPEC).json()["id"]
    bob = logged_in("bob")
    refused = bob.get(f"/jobs/{job_id}/")
    assert refused.status_code == 403
    html = refused.content.decode()
    assert '<nav aria-label="Main">' in html and "<title>Not yours · Bungee</title>" in html
    assert f"Job {job_id} is not yours; only its owner and staff may see its page." in html
    missing = bob.get("/jobs/99999/")
    assert missing.status_code == 404 and "There is no job 99999." in missing.content.decode()
    nowhere = bob.get("/nowhere/")
    assert nowhere.status_code == 404 and "There is no page at /nowhere/." in nowhere.content.decode()
    assert '<nav aria-label="Main">' in nowhere.content.decode()
    anonymous = Client().get("/nowhere/")
    assert anonymous.status_code == 404 and 'href="/login/">Log in</a>' in anonymous.content.decode()
    for path, status in ((f"/api/jobs/{job_id}", 403), ("/api/jobs/99999", 404), ("/api/nowhere", 404)):
        reply = api["bob"].get(path)
        assert reply.status_code == status and reply["Content-Type"].startswith("application/json"), path
        assert reply.json()["error"]["code"] in {"forbidden", "not_found"}


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ({"owner": "nobody"}, "There is no user named “nobody”."),
        ({"owner": "a\x00b"}, "There is no user named “a\N{SYMBOL FOR NULL}b”."),
        ({"state": "sleeping"}, "There is no state “sleeping”; choose one of the list."),
    ],
)
def test_a_jobs_filter_naming_nothing_says_so(users: dict, query: dict[str, str], said: str) -> None:
    page = logged_in("alice").get("/jobs/", query)
    html = page.content.decode()
    assert page.status_code == 400
    assert said in html and "No jobs yet" not in html
    assert 'aria-invalid="true"' in html


def test_a_known_owner_still_filters(api: dict) -> None:
    api["alice"].post("/api/jobs", VALID_SPEC)
    page = logged_in("bob").get("/jobs/", {"owner": "alice"})
    assert page.status_code == 200 and "data-job=" in page.content.decode()
    empty = logged_in("bob").get("/jobs/", {"owner": "bob"})
    assert empty.status_code == 200 and "No jobs match this filter" in empty.content.decode()


def test_a_refusal_is_logged_as_one_line() -> None:
    try:
        raise PermissionError("job 7 is not yours")
    except PermissionError as exc:
        refused = logging.LogRecord("django.request", logging.WARNING, __file__, 1, "Forbidden (Permission denied): %s",
                                    ("/jobs/7/",), (type(exc), exc, exc.__traceback__))
        failed = logging.LogRecord("django.request", logging.ERROR, __file__, 1, "Internal Server Error: %s",
                                   ("/jobs/",), (type(exc), exc, exc.__traceback__))
    refused.status_code = 403
    failed.status_code = 500
    one_line = OneLineRefusals()
    assert one_line.filter(refused) and one_line.filter(failed)
    text = logging.Formatter().format(refused)
    assert text == "Forbidden (Permission denied): /jobs/7/ (job 7 is not yours)"
    assert "Traceback" in logging.Formatter().format(failed), "a server error keeps its traceback"


def test_a_live_socket_may_hear_nothing_for_longer_than_the_layers_blocking_pop() -> None:
    """The channel layer waits for a socket's next message with a blocking pop; a read timeout
    no longer than that pop (redis-py 8's default, 5 s) failed every socket quiet for 5 s, with a
    traceback in the log and the browser dropped."""
    from channels.layers import get_channel_layer
    from channels_redis.utils import create_pool

    layer = get_channel_layer()
    for host in layer.hosts:
        pool = create_pool(host)
        read_timeout = pool.connection_class(**pool.connection_kwargs).socket_timeout
        assert read_timeout is None or read_timeout > layer.brpop_timeout
