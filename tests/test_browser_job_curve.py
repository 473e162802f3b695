"""The job page's charts in real Chromium after a restart that went back to the checkpoint: a
marker on the loss and throughput charts says where the run went back to, and the progress says
it rolled back instead of silently going backwards. A rollback seen live (a progress event of a
newer generation at a step already shown) is marked too. The rows are written straight into the
platform's database and the events onto its channel layer, as ingest does for a training job."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from channels_redis.core import RedisChannelLayer

from tests.browser_support import log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROWS = """
INSERT INTO jobs_jobmetric (job_id, generation, step, loss, samples_per_s, metrics, at)
SELECT %(job)s, %(generation)s, s, 2.0 / (1 + s * 0.01) + 0.05 * %(generation)s, 90 + %(generation)s * 10,
       '{}'::jsonb, now() - interval '1 hour' + (%(generation)s * 1000 + s) * interval '1 second'
FROM generate_series(%(first)s::int, %(last)s::int) AS s
"""


def progress(platform: Any, db: psycopg.Connection, job_id: int, generation: int, steps: range) -> None:
    """Rows for `steps`, then the live events ingest sends for them."""
    db.execute(ROWS, {"job": job_id, "generation": generation, "first": steps[0], "last": steps[-1]})

    async def send() -> None:
        layer = RedisChannelLayer(hosts=[platform.env["REDIS_URL"]], prefix=platform.env["BUNGEE_CHANNEL_PREFIX"])
        for step in steps:
            event = {"type": "progress", "job_id": job_id, "generation": generation, "step": step,
                     "total_steps": 1_000_000, "loss": 0.1, "samples_per_s": 120.0, "metrics": {}, "at": time.time()}
            await layer.group_send(f"job-{job_id}", {"type": "live.event", "event": event})

    # Playwright's own event loop runs in this thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, send()).result()


def job_page(chromium: Any, platform: Any, job_id: int) -> tuple[Any, list[str]]:
    """Alice's page of job `job_id`, live, and the list its script errors are collected in."""
    page = log_in(chromium, platform, "alice", viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{platform.base_url}/jobs/{job_id}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    return page, errors


def test_a_rollback_is_marked_on_the_charts_and_in_the_progress(browser_platform: Any, chromium: Any) -> None:
    platform = browser_platform
    # More workers than the cluster has: the job stays queued, and trains nothing of its own.
    job_id = submit_job(platform, "alice", name="rolled-back", min_workers=5, max_workers=5)
    with psycopg.connect(platform.env["DATABASE_URL"], autocommit=True) as db:
        db.execute(ROWS, {"job": job_id, "generation": 1, "first": 1, "last": 771})
        db.execute(ROWS, {"job": job_id, "generation": 2, "first": 26, "last": 700})
        db.execute("UPDATE jobs_job SET steps_done = 700 WHERE id = %s", [job_id])
    page, errors = job_page(chromium, platform, job_id)
    for chart in ("#loss-chart", "#speed-chart"):
        marker = page.locator(f"{chart} .rollback-marker")
        marker.wait_for(timeout=10_000)
        assert marker.count() == 1
        assert marker.inner_text() == "rolled back to step 25"
        plot, mark = page.locator(f"{chart} .u-over").bounding_box(), marker.bounding_box()
        assert plot and mark
        # Step 25 of 1..771 lies near the left edge of the plot, not at either end.
        assert plot["x"] < mark["x"] < plot["x"] + plot["width"] * 0.1, (plot, mark)
    progress_text = page.locator("#facts dt:text('Progress') + dd")
    assert progress_text.inner_text() == "700 / 1000000 steps (rolled back from step 771 to 25)"
    screenshot(page, "job-page-rollback")

    with psycopg.connect(platform.env["DATABASE_URL"], autocommit=True) as db:
        progress(platform, db, job_id, 2, range(701, 706))
        page.wait_for_function("() => document.querySelector('#facts').textContent.includes('705 / 1000000')")
        # Every worker gone again: generation 3 resumed from the checkpoint of step 600.
        progress(platform, db, job_id, 3, range(601, 603))
    markers = page.locator("#loss-chart .rollback-marker")
    markers.nth(1).wait_for(timeout=10_000)
    assert markers.all_inner_texts() == ["rolled back to step 25", "rolled back to step 600"]
    assert progress_text.inner_text() == "602 / 1000000 steps (rolled back from step 705 to 600)"
    screenshot(page, "job-page-rollback-live")
    assert errors == []
    platform.api("alice").post(f"/api/jobs/{job_id}/cancel")
    page.context.close()
