"""The job list in real Chromium: a job submitted while the page is open appears on it, and a
filter keeps out what it should, without a reload."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import cancel_all, log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_new_jobs_appear_live_and_filters_hold(browser_platform: Any, chromium: Any) -> None:
    page = log_in(chromium, browser_platform, "bob")
    page.goto(browser_platform.base_url + "/jobs/?owner=alice")
    page.wait_for_selector("#conn-state[data-state=live]")
    alices = submit_job(browser_platform, "alice", name="listed", max_workers=1)
    bobs = submit_job(browser_platform, "bob", name="filtered-out", max_workers=1)
    row = page.locator(f'#jobs tr[data-job="{alices}"]')
    row.wait_for(timeout=10_000)
    assert "listed" in row.inner_text() and row.locator("a").count() == 0, "bob may not open alice's job"
    page.wait_for_timeout(1500)
    assert page.locator(f'#jobs tr[data-job="{bobs}"]').count() == 0
    assert page.evaluate("() => performance.getEntriesByType('navigation').length") == 1
    screenshot(page, "job-list")
    cancel_all(browser_platform, "alice")
    cancel_all(browser_platform, "bob")
