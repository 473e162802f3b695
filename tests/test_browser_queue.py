"""The queue explains itself in real Chromium: a running job's bar says how far it is and when it
should end; a queued job says its place, its estimated start and the jobs it waits for (pinned or
not), on the board and on its page; the resize timeline says who asked and when it landed."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.browser_support import cancel_all, log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_progress_eta_place_in_queue_and_holders(browser_platform: Any, chromium: Any) -> None:
    runner = submit_job(browser_platform, "alice", name="runner", min_workers=3, max_workers=4, steps=200_000)
    alice = browser_platform.api("alice")
    browser_platform.wait_for("the runner on 4", lambda: alice.get(f"/api/jobs/{runner}").json()["workers"] == 4)
    assert alice.post(f"/api/jobs/{runner}/resize", json={"workers": 3}).status_code == 200

    def landed() -> bool:
        job = alice.get(f"/api/jobs/{runner}").json()
        return job["state"] == "running" and job["workers"] == 3 and bool(job["finish_estimate_at"])

    browser_platform.wait_for("the pin to 3 to land", landed, timeout_s=120)
    waiter = submit_job(browser_platform, "bob", name="waiter", min_workers=2, max_workers=2)
    page = log_in(chromium, browser_platform, "alice")
    running = page.locator(f'.job-row[data-job="{runner}"] [data-field="progress"]')
    queued = page.locator(f'.job-row[data-job="{waiter}"] [data-field="progress"]')
    running.wait_for()
    page.wait_for_function(
        """(id) => /^\\d+% · about .+ left$/.test(document.querySelector(
             `.job-row[data-job="${id}"] [data-field="progress"]`)?.textContent || "")""",
        arg=runner, timeout=60_000,
    )
    page.wait_for_function(
        """(id) => (document.querySelector(`.job-row[data-job="${id}"] [data-field="progress"]`)?.textContent || "")
             .includes("starts in about")""",
        arg=waiter, timeout=60_000,
    )
    text = queued.inner_text()
    assert text.startswith("1st of 1 in the queue · starts in about "), text
    assert f"waits for #{runner} runner (alice, 3 devices, pinned, ends in about " in text, text
    assert re.fullmatch(r"\d+% · about .+ left", running.inner_text())
    screenshot(page, "board-queue-and-progress")

    page.goto(f"{browser_platform.base_url}/jobs/{runner}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    progress = page.locator("#facts dt:text-is('Progress') + dd")
    assert re.fullmatch(r"\d+ / 200000 steps \(\d+% · about .+ left\)", progress.inner_text()), progress.inner_text()
    # The timeline: who asked for the resize, its pause and the time it took to land.
    # (The scheduler may add rows of its own, such as a straggler replaced on a busy machine.)
    rows = [row.locator("td").all_inner_texts() for row in page.locator("#resizes tbody tr").all()]
    manual = [cells for cells in rows if cells[2] == "manual resize (asked by alice)"]
    assert manual and re.fullmatch(r"\d+\.\d s", manual[-1][5]), rows
    screenshot(page, "job-running-timeline")
    bob = log_in(chromium, browser_platform, "bob")
    bob.goto(f"{browser_platform.base_url}/jobs/{waiter}/")
    bob.wait_for_selector("#conn-state[data-state=live]")
    assert bob.locator("#facts dt:text-is('Queue') + dd").inner_text().startswith("1st of 1 in the queue · starts in about")
    assert bob.locator("#facts dt:text-is('Waiting for') + dd").inner_text().startswith(f"#{runner} runner (alice, 3 devices, pinned")
    screenshot(bob, "job-queued")
    cancel_all(browser_platform, "bob")
    cancel_all(browser_platform, "alice")
