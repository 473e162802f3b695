"""`/metrics` against the real database: who may read it, that prometheus_client's own parser
reads it, and that a job's resize and a device's sample move its numbers. (The integration run
in test_integration_backbone scrapes it from a running platform.)"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from elastic.wire import AgentReport, DeviceSample
from portal.accounts.models import ApiToken
from portal.jobs.agents import ingest_report
from portal.jobs.models import ResizeEvent
from portal.scheduling.cycle import run_cycle
from tests.test_scheduler_cycle import form, submit

pytestmark = pytest.mark.django_db


def scrape(token: str) -> dict[str, Any]:
    reply = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert reply.status_code == 200, reply.content[:300]
    assert reply["Content-Type"].startswith("text/plain; version=")
    return {family.name: family for family in text_string_to_metric_families(reply.content.decode())}


def value(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    found = [s.value for s in family.samples if s.name == (sample or name) and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, family.samples)
    return float(found[0])


@pytest.fixture
def metrics_token(users: dict[str, Any]) -> str:
    return ApiToken.issue(users["staff"], "prometheus", ApiToken.Role.METRICS)[1]


def test_only_metrics_tokens_and_staff_may_read(tokens: dict[str, str], metrics_token: str, users: Any) -> None:
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthenticated"
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    for role in ("alice", "agent"):
        refused = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {tokens[role]}")
        assert refused.status_code == 403 and "role" in refused.json()["error"]["message"]
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer bng_nothing").status_code == 401
    browser = Client()
    browser.force_login(users["alice"])
    assert browser.get("/metrics").status_code == 403, "a user's session is not enough"
    browser.force_login(users["staff"])
    assert browser.get("/metrics").status_code == 200
    assert scrape(metrics_token)


def test_a_resize_and_a_sample_move_the_numbers(api: dict, cluster: Any, metrics_token: str) -> None:
    before = scrape(metrics_token)
    assert value(before, "bungee_nodes", state="online") == 1
    assert value(before, "bungee_resize_pause_seconds", "bungee_resize_pause_seconds_count") == 0
    job = submit(api, max_workers=2)
    run_cycle()
    job.refresh_from_db()
    form(cluster, job, 2, pause_s=0.2, step=0)
    ingest_report(
        cluster,
        AgentReport(node=cluster.name, samples=[
            DeviceSample(index=0, taken_at=time.time(), utilization_pct=75.0, memory_used_bytes=1 << 20,
                         memory_total_bytes=1 << 30, owner_present=False)
        ]),
    )  # fmt: skip
    after = scrape(metrics_token)
    labels = {"job_id": str(job.pk), "user": "alice"}
    assert value(after, "bungee_job_workers", **labels) == 2
    assert value(after, "bungee_jobs", state="running") == 1
    assert value(after, "bungee_resizes", "bungee_resizes_total", reason="scheduler") == 1
    assert value(after, "bungee_resize_pause_seconds", "bungee_resize_pause_seconds_count") == 1
    assert value(after, "bungee_resize_pause_seconds", "bungee_resize_pause_seconds_bucket", le="0.25") == 1
    assert value(after, "bungee_resize_pause_seconds", "bungee_resize_pause_seconds_bucket", le="0.1") == 0
    assert value(after, "bungee_resize_land_seconds", "bungee_resize_land_seconds_count") == 1
    assert value(after, "bungee_scheduler_decision_seconds", "bungee_scheduler_decision_seconds_count") >= 1
    device = value(after, "bungee_device_utilization_ratio", node=cluster.name, device="0")
    assert device == 0.75
    uuid = next(s.labels["UUID"] for s in after["bungee_device_utilization_ratio"].samples)
    assert uuid and after["bungee_device_utilization_ratio"].samples[0].labels["Hostname"] == cluster.address
    api["alice"].post(f"/api/jobs/{job.pk}/cancel")
    ended = scrape(metrics_token)
    assert not [s for s in ended["bungee_job_workers"].samples if s.labels["job_id"] == str(job.pk)], (
        "a finished job leaves the per-job series: their number stays bounded"
    )


def test_resize_histograms_are_counted_over_every_row(api: dict, metrics_token: str) -> None:
    """Buckets, count and sum of the pause and land histograms, which the database counts (a
    scrape reads no rows): one resize per bucket edge case, one not landed yet, one with no pause."""
    job = submit(api, max_workers=2)
    asked = timezone.now()
    cases = [(0.3, 0.04), (0.8, 0.2), (1.0, None), (3.0, 1.5), (200.0, 0.1)]  # land s, pause s
    for generation, (land, pause) in enumerate(cases, start=1):
        ResizeEvent.objects.create(
            job=job, generation=generation, reason="manual", workers_before=1, workers_after=2,
            requested_at=asked, completed_at=asked + timedelta(seconds=land), pause_s=pause,
        )  # fmt: skip
    ResizeEvent.objects.create(job=job, generation=99, reason="manual", workers_before=2, workers_after=1)
    got = scrape(metrics_token)

    def bucket(name: str, le: str) -> float:
        return value(got, name, f"{name}_bucket", le=le)

    land = "bungee_resize_land_seconds"
    assert [bucket(land, le) for le in ("0.25", "0.5", "1.0", "2.5", "5.0", "120.0", "+Inf")] == [0, 1, 3, 3, 4, 4, 5]
    assert value(got, land, f"{land}_count") == 5
    assert value(got, land, f"{land}_sum") == pytest.approx(205.1)
    pause = "bungee_resize_pause_seconds"
    assert [bucket(pause, le) for le in ("0.05", "0.1", "0.25", "1.0", "2.5", "+Inf")] == [1, 2, 3, 3, 4, 4]
    assert value(got, pause, f"{pause}_count") == 4, "a resize without a pause is not counted as one of 0 s"
    assert value(got, pause, f"{pause}_sum") == pytest.approx(1.84)
