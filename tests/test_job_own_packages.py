"""A job's own packages reach the portal from the node that built (or found) its environment, as
an "environment" event of its agent's report, taken only from a node the job was placed on and
only within its bounds (elastic.wire.OwnPackages); the job's API detail, its page and `bungee
status` show them; `bungee download`'s requirements.lock pins them. The whole path, from a real
build to the downloaded lock, runs in tests/test_integration_resize_in_place.py."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from bungee_cli.main import lock_text, own_packages_rows
from elastic.wire import OwnPackages
from portal.jobs.models import Job
from tests import test_reports_from_placed_workers
from tests.test_reports_from_placed_workers import event, refusals, report

pytestmark = pytest.mark.django_db

placed = test_reports_from_placed_workers.placed

OWN = {"digest": "ab" * 32, "source": "requirements.txt", "requirements": ["einops==0.8.1", "tqdm>=4"],
       "packages": {"einops": "0.8.1", "tqdm": "4.67.1"}, "left_out": 0}


def environment_event(job: Job, rank: int, own: dict[str, Any] = OWN) -> dict[str, Any]:
    return event(job, "environment", rank=rank, own_packages=own)


def test_the_placed_node_reports_them_and_the_api_page_and_status_show_them(
    placed: dict, users: dict, api: dict
) -> None:
    job, rank = placed["job"], placed["rank_of"]["node-a"]
    page = Client()
    page.force_login(users["alice"])
    assert "Own packages" not in page.get(f"/jobs/{job.pk}/").content.decode(), "none before a node reports them"
    reply = placed["clients"]["node-a"].post("/api/agent/report", report("node-a", [environment_event(job, rank)]))
    assert reply.status_code == 200 and reply.json()["refused"] == [], reply.content

    assert api["bob"].get(f"/api/jobs/{job.pk}").status_code == 403, "another user sees nothing of them"
    shown = api["alice"].get(f"/api/jobs/{job.pk}").json()["own_packages"]
    assert shown == {**OWN, "node": "node-a"}

    html = page.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="own-packages"' in html and "<code title=\"" + OWN["digest"] + "\">abababababab</code>" in html and "as node node-a built it" in html
    assert "<code>einops==0.8.1</code>" in html and "<td>tqdm</td><td>4.67.1</td>" in html

    rows = dict(own_packages_rows({"own_packages": shown}))
    assert rows["own packages"] == "einops==0.8.1, tqdm>=4 (from requirements.txt; environment abababababab on node-a)"
    assert rows["installed"] == "einops==0.8.1, tqdm==4.67.1"


def test_another_nodes_report_of_them_is_refused(placed: dict) -> None:
    job = placed["job"]
    node_b_rank = placed["rank_of"]["node-b"]
    reply = placed["clients"]["node-a"].post("/api/agent/report",
                                             report("node-a", [environment_event(job, node_b_rank)]))
    assert reply.status_code == 200, reply.content
    assert "node node-a does not hold rank" in reply.json()["refused"][0]["message"]
    assert refusals("node-a") == 1
    job.refresh_from_db()
    assert job.own_packages is None


@pytest.mark.parametrize(
    "own",
    [
        {**OWN, "digest": "not a digest"},
        {**OWN, "packages": {f"p{n}": "1" * 200 for n in range(400)}},
        {**OWN, "requirements": ["x" * 5000]},
    ],
    ids=["bad digest", "over its characters", "overlong requirement"],
)
def test_a_report_of_them_over_their_bounds_is_refused(placed: dict, own: dict[str, Any]) -> None:
    job, rank = placed["job"], placed["rank_of"]["node-a"]
    reply = placed["clients"]["node-a"].post("/api/agent/report", report("node-a", [environment_event(job, rank, own)]))
    assert reply.status_code == 200, reply.content
    [refused] = reply.json()["refused"]
    assert refused["item"] == "events[0]" and refused["message"].startswith("own_packages"), refused
    job.refresh_from_db()
    assert job.own_packages is None


def test_the_lock_pins_every_package_after_the_index_lines_and_names_python_and_torch() -> None:
    manifest = {"environment": {"python": "3.11.9 (main, Apr  2 2024)", "torch": "2.13.0+cpu", "torch_cuda": None,
                                "own_packages": {**OWN, "requirements": ["--extra-index-url https://lab/simple",
                                                                          "einops==0.8.1"]}}}
    lock = lock_text(7, manifest)
    assert lock is not None
    lines = lock.splitlines()
    assert "# They ran beside the node's Python 3.11.9 and torch 2.13.0+cpu (CPU build), which this file does " \
           "not install." in lines
    assert [line for line in lines if not line.startswith("#")] == [
        "--extra-index-url https://lab/simple", "einops==0.8.1", "tqdm==4.67.1"
    ]
    assert lock_text(7, {"environment": {"python": "3.11.9", "torch": "2.13.0", "own_packages": None}}) is None
    assert lock_text(7, {"job_id": 7}) is None, "a manifest from before environments were recorded"


def test_a_record_too_big_for_its_bounds_leaves_out_the_last_packages_and_counts_them() -> None:
    packages = {f"package-{n:05d}": "1.0." + "9" * 100 for n in range(1000)}
    fitted = OwnPackages.fitted("ab" * 32, "requirements.txt", ["big==1"], packages)
    kept = len(fitted.packages)
    assert 0 < kept < 1000 and fitted.left_out == 1000 - kept and fitted.requirements == ["big==1"]
    assert list(fitted.packages) == sorted(packages)[:kept], "the first by name are kept"
    assert OwnPackages.model_validate_json(fitted.model_dump_json()) == fitted, "what it keeps passes its own check"
    small = OwnPackages.fitted("ab" * 32, "pyproject.toml", ["einops"], {"einops": "0.8.1"})
    assert (small.left_out, small.packages) == (0, {"einops": "0.8.1"})
