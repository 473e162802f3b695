"""Resizes on the job page's charts, and a failed job's reason on the jobs page, in real Chromium.
Each resize of a running job (not its first start) is a line on the loss and throughput charts at
the step it switched at, labelled with the sizes, its details in a tooltip. The rows are written
straight into the platform's database, as ingest writes them for a training job."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.browser_support import screenshot, submit_job
from tests.test_browser_job_curve import ROWS, job_page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

RESIZE = """
INSERT INTO jobs_resizeevent (job_id, generation, reason, workers_before, workers_after, devices_before,
                              devices_after, requested_at, requested_by, completed_at, pause_s, step,
                              members_before, members_after, phases)
VALUES (%(job)s, %(generation)s, %(reason)s, %(before)s, %(after)s, '[]', '[]', now(), '', now(), %(pause)s,
        %(step)s, '[]', '[]', '{}')
"""


def test_each_resize_is_marked_on_the_charts(browser_platform: Any, chromium: Any) -> None:
    platform = browser_platform
    # More workers than the cluster has: the job stays queued, and trains nothing of its own.
    job_id = submit_job(platform, "alice", name="resized", min_workers=5, max_workers=5)
    with psycopg.connect(platform.env["DATABASE_URL"], autocommit=True) as db:
        for generation, first, last in ((1, 1, 300), (2, 301, 600), (3, 601, 800)):
            db.execute(ROWS, {"job": job_id, "generation": generation, "first": first, "last": last})
        for generation, before, after, step in ((1, 0, 1, 0), (2, 1, 3, 300), (3, 3, 2, 600)):
            db.execute(RESIZE, {"job": job_id, "generation": generation, "reason": "fair share", "before": before,
                                "after": after, "step": step, "pause": 0.42})
        db.execute("UPDATE jobs_job SET steps_done = 800 WHERE id = %s", [job_id])
    page, errors = job_page(chromium, platform, job_id)
    for chart in ("#loss-chart", "#speed-chart"):
        markers = page.locator(f"{chart} .resize-marker")
        markers.nth(1).wait_for(timeout=10_000)
        assert markers.count() == 2, "the first start is no resize"
        assert markers.all_inner_texts() == ["1 → 3 workers", "3 → 2 workers"]
        assert markers.nth(0).locator("span").get_attribute("title") == (
            "resized from 1 to 3 workers at step 300 (generation 2, fair share, paused 0.42 s)"
        )
        plot = page.locator(f"{chart} .u-over").bounding_box()
        first, second = markers.nth(0).bounding_box(), markers.nth(1).bounding_box()
        assert plot and first and second
        # Steps 300 and 600 of 1..800: at about 37% and 75% of the plot's width.
        for mark, share in ((first, 299 / 799), (second, 599 / 799)):
            assert abs(mark["x"] - (plot["x"] + plot["width"] * share)) < plot["width"] * 0.02, (plot, mark, share)
    page.locator("#loss-chart .resize-marker span").first.hover()
    screenshot(page, "job-page-resizes")
    assert errors == []
    platform.api("alice").post(f"/api/jobs/{job_id}/cancel")

    page.goto(f"{platform.base_url}/jobs/?owner=alice")
    reason = page.locator(f'#jobs tr[data-job="{job_id}"] [data-field="reason"]')
    assert reason.inner_text() == "cancelled by its owner"
    screenshot(page, "job-list-reasons")
    page.context.close()
