"""The cluster board in real Chromium: live utilisation without reloading; drag-resize with the
mouse and with the keyboard, landing in a second browser too; a size above max refused; a
second user sees the bar but cannot drag it, open the job or cancel it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.browser_support import cancel_all, log_in, screenshot, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def bar(page: Any, job_id: int) -> Any:
    return page.locator(f'.job-row[data-job="{job_id}"] .bar')


def wait_workers(page: Any, job_id: int, workers: int) -> None:
    page.wait_for_function(
        """([id, n]) => { const b = document.querySelector(`.job-row[data-job="${id}"] .bar`);
             return b && b.dataset.workers === String(n) && !b.classList.contains('resizing'); }""",
        arg=[job_id, workers], timeout=90_000,
    )


def drag_to(page: Any, job_id: int, workers: int) -> None:
    # The track, the handle and the cell count in one look: the board redraws its rows on every
    # job update, and a handle found by one call may be gone by the next.
    track, handle, cells = page.evaluate(
        """(id) => { const row = document.querySelector(`.job-row[data-job="${id}"]`);
             const box = (selector) => { const b = row.querySelector(selector).getBoundingClientRect();
                                         return {x: b.x, y: b.y, width: b.width, height: b.height}; };
             return [box('.track'), box('.handle'),
                     Number(getComputedStyle(row.querySelector('.track')).getPropertyValue('--cells'))]; }""",
        job_id,
    )
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    target_x = track["x"] + track["width"] * workers / cells - 2
    page.mouse.move(target_x, handle["y"] + handle["height"] / 2, steps=8)
    page.mouse.up()


def test_utilisation_changes_live(browser_platform: Any, chromium: Any) -> None:
    """The job's device reads busy while it trains and idle once it is cancelled, on the same
    page, which never reloads: each reading is the agent's sample, not a guess of the test's."""
    job_id = submit_job(browser_platform, "alice", name="busy", max_workers=1)
    page = log_in(chromium, browser_platform, "alice")
    bar(page, job_id).wait_for()
    browser_platform.wait_for("the job training", lambda: browser_platform.job(job_id)["steps_done"] > 0,
                              timeout_s=120)
    row = page.locator("#devices tbody tr", has_text=f"#{job_id} busy (alice)")
    row.wait_for()
    device = row.get_attribute("data-device")
    util = f'#devices tr[data-device="{device}"] [data-field=util]'
    # A worker that trains uses its slot: a reading above 0 % comes while the job runs.
    page.wait_for_function(
        "(s) => /^[1-9][0-9]*%$/.test(document.querySelector(s)?.textContent ?? '')", arg=util, timeout=60_000)
    busy = page.locator(util).inner_text()
    screenshot(page, "board")
    cancel_all(browser_platform, "alice")
    # Its worker gone, the same row reads idle by itself.
    page.wait_for_function(
        "(s) => document.querySelector(s)?.textContent === '0%'", arg=util, timeout=60_000)
    assert busy != "0%"
    assert page.evaluate("() => performance.getEntriesByType('navigation').length") == 1, "the page reloaded"


def test_drag_and_keyboard_resize_seen_by_another_browser(browser_platform: Any, chromium: Any) -> None:
    job_id = submit_job(browser_platform, "alice", name="stretchy", min_workers=1, max_workers=3)
    alice = log_in(chromium, browser_platform, "alice")
    watcher = log_in(chromium, browser_platform, "alice")
    wait_workers(alice, job_id, 3)
    browser_platform.api("alice").post(f"/api/jobs/{job_id}/resize", json={"workers": 2})
    wait_workers(alice, job_id, 2)

    drag_to(alice, job_id, 1)
    assert "resizing to 1" in bar(alice, job_id).inner_text() or bar(alice, job_id).get_attribute("data-workers") == "1"
    wait_workers(alice, job_id, 1)
    wait_workers(watcher, job_id, 1)
    screenshot(watcher, "board-after-drag")

    bar(alice, job_id).focus()
    alice.keyboard.press("ArrowRight")
    assert "→ 2" in bar(alice, job_id).inner_text()
    alice.keyboard.press("Enter")
    wait_workers(alice, job_id, 2)
    wait_workers(watcher, job_id, 2)

    drag_to(alice, job_id, 0)
    message = alice.locator("#board-message")
    message.wait_for()
    assert "between 1 and 3" in message.inner_text()
    assert bar(alice, job_id).get_attribute("data-workers") == "2", "the bar snapped back"
    detail = browser_platform.job(job_id)
    assert detail["pinned_workers"] == 2
    screenshot(alice, "board-refused")

    # The job page shows how the 1 -> 2 resize went: the state moved from memory, and each phase.
    alice.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    grown = alice.locator("#resizes tbody tr", has_text="1 → 2").last
    grown.locator("td", has_text="transfer").wait_for(timeout=90_000)
    assert re.search(r"\b[1-9][0-9.]* (kB|MB|GB)\b", grown.inner_text()), grown.inner_text()
    screenshot(alice, "job-page-after-resize")
    cancel_all(browser_platform, "alice")


def test_a_live_update_of_one_job_leaves_the_other_rows_in_place(browser_platform: Any, chromium: Any) -> None:
    """The board redraws only the row of a job that changed: the other rows stay the same
    elements, with their focus (a click or a keyboard draft being made there is not lost). The
    focus stays on its control: on a kept row it is not moved, and a row drawn anew gets it on
    the same control."""
    steady = submit_job(browser_platform, "alice", name="steady", min_workers=1, max_workers=1)
    moving = submit_job(browser_platform, "alice", name="moving", min_workers=1, max_workers=1)
    alice = browser_platform.api("alice")
    assert alice.post(f"/api/jobs/{moving}/resize", json={"workers": 1}).status_code == 200  # a pin
    page = log_in(chromium, browser_platform, "alice")
    wait_workers(page, steady, 1)
    page.get_by_role("button", name="Lift the pin of job moving").wait_for()
    page.wait_for_selector("#conn-state[data-state=live]")
    page.locator(f'.job-row[data-job="{moving}"] .job-label a').focus()
    page.evaluate(
        """([steady, moving]) => {
             window.steadyRow = document.querySelector(`.job-row[data-job="${steady}"]`);
             window.movingRow = document.querySelector(`.job-row[data-job="${moving}"]`);
             window.steadyUpdates = [];
             BungeeLive.on((msg) => {
               (msg.type === "job" ? [msg.job] : msg.type === "jobs" ? msg.jobs : []).forEach((job) => {
                 if (job.id === steady) window.steadyUpdates.push(job);
                 if (job.id === moving) window.movingPinned = job.pinned_workers;
               });
             });
           }""",
        [steady, moving],
    )
    assert alice.post(f"/api/jobs/{moving}/unpin").status_code == 200
    page.wait_for_function("() => window.movingPinned === null", timeout=30_000)
    assert page.evaluate("() => !window.movingRow.isConnected"), "the changed job's row was not redrawn"
    assert page.get_by_role("button", name="Lift the pin of job moving").count() == 0
    kept = page.evaluate(f"""() => window.steadyRow === document.querySelector('.job-row[data-job="{steady}"]')""")
    assert kept, f"the unchanged job's row was replaced; its updates meanwhile: {page.evaluate('window.steadyUpdates')}"
    focused = page.evaluate("() => document.activeElement.outerHTML")
    assert page.evaluate(
        f"""() => document.activeElement === document.querySelector('.job-row[data-job="{moving}"] .job-label a')"""
    ), f"the redrawn row's link lost the focus to {focused}"
    # The focus on a row that is kept is not moved (it went to the row's bar).
    page.locator(f'.job-row[data-job="{steady}"] .job-label a').focus()
    assert alice.post(f"/api/jobs/{moving}/resize", json={"workers": 1}).status_code == 200
    page.wait_for_function("() => window.movingPinned === 1", timeout=30_000)
    page.get_by_role("button", name="Lift the pin of job moving").wait_for()
    focused = page.evaluate("() => document.activeElement.outerHTML")
    assert page.evaluate("() => document.activeElement === window.steadyRow.querySelector('.job-label a')"), focused
    cancel_all(browser_platform, "alice")


def test_second_user_sees_but_cannot_touch(browser_platform: Any, chromium: Any) -> None:
    job_id = submit_job(browser_platform, "alice", name="alices", max_workers=1)
    bob = log_in(chromium, browser_platform, "bob")
    bar(bob, job_id).wait_for()
    assert bar(bob, job_id).get_attribute("role") == "img"
    assert bob.locator(f'.job-row[data-job="{job_id}"] .handle').count() == 0
    assert bob.locator(f'.job-row[data-job="{job_id}"] a').count() == 0, "no link to another's job"
    bar(bob, job_id).focus()
    bob.keyboard.press("ArrowRight")
    bob.keyboard.press("Enter")
    assert browser_platform.job(job_id)["pinned_workers"] is None
    response = bob.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    assert response is not None and response.status == 403
    reply = bob.evaluate(
        """async (id) => { const csrf = document.cookie.match(/csrftoken=([^;]+)/);
             const r = await fetch(`/api/jobs/${id}/cancel`, {method: 'POST', headers: {'X-CSRFToken': csrf ? csrf[1] : ''}});
             return r.status; }""",
        job_id,
    )
    assert reply == 403
    assert browser_platform.job(job_id)["state"] in {"queued", "running", "resizing"}
    cancel_all(browser_platform, "alice")
