"""The portal restarted under an open job page, in real Chromium: the page shows it is offline,
reconnects by itself once the portal is back, re-subscribes and fetches what it missed (here,
the job cancelled while it was away)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.faults]


def test_a_page_reconnects_after_the_portal_restarts_and_catches_up(browser_platform: Any, chromium: Any) -> None:
    platform = browser_platform
    job_id = submit_job(platform, "alice", name="reconnect", max_workers=1)
    page = log_in(chromium, platform, "alice")
    page.goto(f"{platform.base_url}/jobs/{job_id}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url)
            if request.url.endswith(f"/api/jobs/{job_id}") else None)

    platform.kill("portal")
    page.wait_for_selector("#conn-state[data-state=offline]", timeout=30_000)
    platform.start("portal")
    platform.wait_for("the portal again", platform.portal_answers, timeout_s=60)
    assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    page.wait_for_selector("#conn-state[data-state=live]", timeout=30_000)
    page.wait_for_function("() => document.getElementById('job-state').textContent.trim() === 'cancelled'",
                           timeout=30_000)
    assert fetched, "after reconnecting the page fetched the job's state"
    screenshot(page, "job-page-after-portal-restart")
    page.context.close()
