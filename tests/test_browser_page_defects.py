"""Defects seen on the pages, each kept fixed in real Chromium: the job page's "Lift pin" shows
only while the job is pinned and has not ended (the stylesheet's `button` display used to win
over the `hidden` attribute, so it showed on every job)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import cancel_all, log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_lift_pin_shows_only_on_a_pinned_job_that_has_not_ended(browser_platform: Any, chromium: Any) -> None:
    job_id = submit_job(browser_platform, "alice", name="pin-me", max_workers=1)
    page = log_in(chromium, browser_platform, "alice")
    page.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    lift = page.locator("#unpin")
    assert not lift.is_visible(), "an unpinned job has no pin to lift"
    alice = browser_platform.api("alice")
    assert alice.post(f"/api/jobs/{job_id}/resize", json={"workers": 1}).status_code == 200
    lift.wait_for(state="visible", timeout=10_000)
    screenshot(page, "job-pinned")
    assert alice.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    page.wait_for_selector("#job-state:text('cancelled')", timeout=10_000)
    lift.wait_for(state="hidden", timeout=10_000)
    screenshot(page, "job-cancelled-no-lift-pin")
    cancel_all(browser_platform, "alice")
