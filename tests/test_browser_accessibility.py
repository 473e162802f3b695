"""The main pages pass axe-core's WCAG 2 A/AA checks (labels, contrast, structure) in both
themes, keep a sensible focus order, and fit a narrow window."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import axe_violations, cancel_all, log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_main_pages_pass_axe(browser_platform: Any, chromium: Any, theme: str) -> None:
    job_id = submit_job(browser_platform, "alice", name="a11y", max_workers=1)
    page = log_in(chromium, browser_platform, "alice", color_scheme=theme)
    for path in ("/", "/jobs/", "/jobs/new/", f"/jobs/{job_id}/"):
        page.goto(browser_platform.base_url + path)
        page.wait_for_selector("#conn-state[data-state=live]")
        page.wait_for_timeout(500)
        assert axe_violations(page) == [], (theme, path)
    cancel_all(browser_platform, "alice")


def test_focus_order_and_narrow_window(browser_platform: Any, chromium: Any) -> None:
    job_id = submit_job(browser_platform, "alice", name="narrow", max_workers=1)
    page = log_in(chromium, browser_platform, "alice", viewport={"width": 380, "height": 800})
    page.locator(f'.job-row[data-job="{job_id}"] .bar').wait_for()
    order = []
    for _ in range(12):
        page.keyboard.press("Tab")
        order.append(page.evaluate("() => document.activeElement.textContent.trim().slice(0, 30) || document.activeElement.getAttribute('aria-label')"))
    assert order[0] == "Skip to content"
    assert order.index("Cluster") < order.index("Jobs") < order.index("Submit")
    assert any(item and "worker" in item for item in order), order
    overflow = page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1, f"the page scrolls sideways by {overflow}px in a 380px window"
    screenshot(page, "board-narrow")
    cancel_all(browser_platform, "alice")
