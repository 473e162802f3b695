"""The staff page of the scheduler (/admin/scheduler/) and its API: the latest decision with its
time, policy, decision time, every job's target and reason, and the devices lent. Staff only:
other users get 403, anonymous visitors the login page."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from portal.cluster.models import Device
from portal.scheduling.cycle import run_cycle
from tests.conftest import VALID_SPEC

pytestmark = pytest.mark.django_db


def logged_in(name: str) -> Client:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.get(username=name))
    return client


def test_no_decision_yet(users: dict, api: dict) -> None:
    page = logged_in("root").get("/admin/scheduler/")
    assert page.status_code == 200 and b"has not decided anything yet" in page.content
    reply = api["staff"].get("/api/scheduler/decisions/latest")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


def test_staff_see_the_latest_decision(api: dict, cluster: Any, redis_client: Any) -> None:
    Device.objects.filter(node=cluster, index=3).update(owner="carol")
    reply = api["alice"].post(
        "/api/jobs", {**VALID_SPEC, "name": "borrower", "max_workers": 4, "priority": "opportunistic"}
    )
    job_id = reply.json()["id"]
    run_cycle()
    page = logged_in("root").get("/admin/scheduler/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="policy-name">bungee<' in html and " ms</dd>" in html
    assert f'data-job="{job_id}"' in html and "borrower" in html
    assert "node-a/3 (owner carol) lent to job #" in html
    assert "1 borrowed device that their owner may take back" in html
    decision = api["staff"].get("/api/scheduler/decisions/latest").json()
    assert decision["policy"] == "bungee" and decision["decision_ms"] > 0 and decision["resize_cost_s"] == 1.0
    [row] = decision["jobs"]
    assert row["id"] == job_id and len(row["target"]) == 4 and "borrowed device" in row["reasons"]
    assert decision["lent_devices"] == [{"device": "node-a/3", "owner": "carol", "job": job_id}]
    assert decision["changed_jobs"] == [job_id]


def test_only_staff(users: dict, api: dict, cluster: Any, redis_client: Any) -> None:
    run_cycle()
    refused = logged_in("alice").get("/admin/scheduler/")
    assert refused.status_code == 403
    assert Client().get("/admin/scheduler/").status_code == 302
    reply = api["bob"].get("/api/scheduler/decisions/latest")
    assert reply.status_code == 403 and "bob is not staff" in reply.json()["error"]["message"]
    assert api["anonymous"].get("/api/scheduler/decisions/latest").status_code == 401


def test_the_nav_links_the_page_for_staff_only(users: dict) -> None:
    assert b'href="/admin/scheduler/"' in logged_in("root").get("/").content
    assert b'href="/admin/scheduler/"' not in logged_in("alice").get("/").content
