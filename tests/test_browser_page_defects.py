"""Defects seen on the pages, each kept fixed in real Chromium: the job page's "Lift pin" shows
only while the job is pinned and has not ended (the stylesheet's `button` display used to win
over the `hidden` attribute, so it showed on every job). And: a queued job has no stub
bar; job colours stay distinct and readable far beyond a dozen jobs, in both themes; simulated
readings say so; the board fits a 380 px window; counts read "1 worker"; a hybrid job shows one
global batch; the 403 and 404 pages are the site's, with the reason; a jobs filter naming no
user says so; a rule across hyperparameters is shown beside them; and neither a refusal nor a
closed tab leaves a traceback in the portal's log."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest

from tests.browser_support import axe_violations, cancel_all, log_in, screenshot, submit_job

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


def facts(page: Any) -> dict[str, str]:
    return dict(zip(page.locator("#facts dt").all_inner_texts(), page.locator("#facts dd").all_inner_texts(), strict=True))


def test_an_ended_job_shows_how_it_ended_and_nothing_live(browser_platform: Any, chromium: Any) -> None:
    """Empty charts say "no data yet"; when the job ends its live
    controls go (the page of an ended job has none) and the facts say how it ended and for how long."""
    # More workers than the cluster has: the job stays queued and trains nothing.
    job_id = submit_job(browser_platform, "alice", name="never-ran", min_workers=5, max_workers=5)
    page = log_in(chromium, browser_platform, "alice")
    page.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    for chart in ("#loss-chart", "#speed-chart"):
        assert page.locator(f"{chart} .chart-empty").inner_text() == "no data yet"
    # The empty tables and the empty log say so too.
    assert page.locator("#resizes tbody").inner_text().strip() == "no workers yet"
    assert page.locator("#log").inner_text() == "" and page.get_attribute("#log", "data-empty") == "no log lines yet"
    assert page.locator("#resize-to").is_visible() and "Workers" in facts(page)
    screenshot(page, "job-queued-no-data-yet")
    assert browser_platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    page.locator("#live-controls").wait_for(state="detached", timeout=10_000)
    shown = facts(page)
    assert not {"Workers", "Progress", "Generation", "Scheduler"} & set(shown), shown
    assert shown["Ended"].startswith("cancelled at step 0 of 1000000, "), shown
    assert re.fullmatch(r"never started \(\d+ (s|min \d+ s) queued\)", shown["Ran for"]), shown
    assert page.inner_text("#job-message") == "cancelled by its owner"
    assert page.locator("#loss-chart .chart-empty").inner_text() == "no data: the job trained no step"
    page.wait_for_selector("#resizes tbody :text('none: the job never had workers')", timeout=10_000)
    assert page.get_attribute("#log", "data-empty") == "no log lines: the job's workers wrote none"
    screenshot(page, "job-cancelled-ended")
    assert axe_violations(page) == []
    page.reload()
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.locator("#resize-to, #resize, #cancel, #unpin").count() == 0
    assert "Ended" in facts(page)
    page.context.close()


def _linear(channel: float) -> float:
    channel /= 255
    return channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4


def contrast(a: list[int], b: list[int]) -> float:
    """WCAG 2's contrast ratio of two sRGB colours."""
    light, dark = sorted((0.2126 * _linear(c[0]) + 0.7152 * _linear(c[1]) + 0.0722 * _linear(c[2]) for c in (a, b)),
                         reverse=True)
    return (light + 0.05) / (dark + 0.05)


def lab(rgb: list[int]) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour, for the CIE76 colour difference."""
    r, g, b = (_linear(c) for c in rgb)
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


JOB_COLOURS = """(ids) => {
  // Each job's bar colour as the page paints it (a canvas turns any CSS colour into sRGB).
  const probe = document.createElement("div");
  probe.className = "bar";
  document.body.appendChild(probe);
  const context = Object.assign(document.createElement("canvas"), { width: 1, height: 1 }).getContext("2d");
  const rgb = (colour) => {
    context.clearRect(0, 0, 1, 1);
    context.fillStyle = colour;
    context.fillRect(0, 0, 1, 1);
    return [...context.getImageData(0, 0, 1, 1).data.slice(0, 3)];
  };
  const bars = ids.map((id) => { probe.setAttribute("style", BungeeFormat.jobColour(id)); return rgb(getComputedStyle(probe).backgroundColor); });
  const text = rgb(getComputedStyle(probe).color);
  probe.remove();
  return { bars, text };
}"""
NEIGHBOURS = 40
"""Jobs on the board at once have ids close to each other: any two within this many ids must
differ visibly (CIE76 difference of 4.5 and more; 2.3 is barely noticeable side by side)."""


def check_job_colours(page: Any) -> None:
    painted = page.evaluate(JOB_COLOURS, list(range(1, 201)))
    colours = [lab(rgb) for rgb in painted["bars"]]
    closest = min(
        (math.dist(colours[i], colours[j]), i + 1, j + 1)
        for i, j in itertools.combinations(range(len(colours)), 2) if j - i < NEIGHBOURS
    )
    assert closest[0] >= 4.5, f"jobs {closest[1]} and {closest[2]} look alike (difference {closest[0]:.1f})"
    worst = min(contrast(rgb, painted["text"]) for rgb in painted["bars"])
    assert worst >= 4.5, f"a bar's text has only {worst:.2f}:1 contrast"


def test_board_queued_job_colours_simulated_readings_and_a_narrow_window(browser_platform: Any, chromium: Any) -> None:
    alice = browser_platform.api("alice")
    running = submit_job(browser_platform, "alice", name="runs", max_workers=1)
    browser_platform.wait_for("a job on a device", lambda: alice.get(f"/api/jobs/{running}").json()["workers"] == 1)
    # Pinned, so that the job below stays queued: unpinned, the scheduler may rightly stop this
    # one-worker job to run the four-worker one (the policy values 4 workers above 1).
    assert alice.post(f"/api/jobs/{running}/resize", json={"workers": 1}).status_code == 200
    queued = submit_job(browser_platform, "alice", name="waits", min_workers=4, max_workers=4)
    page = log_in(chromium, browser_platform, "alice")
    waiting = page.locator(f'.job-row[data-job="{queued}"] .bar')
    waiting.wait_for()
    assert "empty" in (waiting.get_attribute("class") or "") and waiting.inner_text() == "queued: no workers yet"
    assert waiting.evaluate("b => getComputedStyle(b).backgroundColor") == "rgba(0, 0, 0, 0)", "no stub of a bar"
    assert page.locator(f'.job-row[data-job="{running}"] .bar').inner_text() == "1 worker"
    # A job's track has a cell per worker it may have, not one per device.
    cells = "(t) => getComputedStyle(t).getPropertyValue('--cells').trim()"
    assert page.locator(f'.job-row[data-job="{running}"] .track').evaluate(cells) == "1"
    assert page.locator(f'.job-row[data-job="{queued}"] .track').evaluate(cells) == "4"
    # A free device whose memory is in use says why: the agent's warm standby holds it.
    row = page.locator("#devices tbody tr").filter(has=page.locator('[data-field="holder"] .standby')).first
    row.wait_for(timeout=60_000)
    standby = row.locator('[data-field="holder"] .standby')
    assert row.locator('[data-field="holder"] .tag').inner_text() == "free"
    assert "held by a warm standby" in (standby.get_attribute("title") or "")
    assert "held by a warm standby" in (row.locator('[data-field="mem"]').get_attribute("title") or "")
    assert re.fullmatch(r"warm standby · \d+(\.\d)? [KMG]B", row.locator('[data-field="share"]').inner_text())
    page.wait_for_selector('#devices [data-field="power"] .sim')
    assert page.locator('#devices [data-field="temp"] .sim').count() == 4, "every slot's temperature is simulated"
    assert page.locator("#simulated-note").is_visible()
    assert re.match(r"1 node · 4 devices · \d free · \d+ active jobs?$", page.inner_text("#board-summary"))
    assert not re.search(r"\b1 (workers|devices|nodes)\b", page.inner_text("main"))
    assert axe_violations(page) == []
    check_job_colours(page)
    screenshot(page, "board-queued-job-simulated-readings")
    page.click("#theme-toggle")
    assert page.evaluate("() => document.documentElement.dataset.theme") == "dark"
    assert axe_violations(page) == []
    check_job_colours(page)
    screenshot(page, "board-dark")

    page.set_viewport_size({"width": 380, "height": 900})
    page.click("#theme-toggle")
    first = page.locator("#devices tbody tr").first
    for field in ("holder", "share", "temp", "power"):
        box = first.locator(f'[data-field="{field}"]').bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 380, (field, box)
    assert first.locator('[data-field="holder"]').evaluate("c => getComputedStyle(c, '::before').content") == '"Held by"'
    overflow = page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1, f"the board scrolls sideways by {overflow}px in a 380px window"
    screenshot(page, "board-380px")
    page.context.close()
    cancel_all(browser_platform, "alice")


def test_job_page_error_pages_and_a_quiet_log(browser_platform: Any, chromium: Any) -> None:
    portal_log = browser_platform.group.log_dir / "portal.log"
    logged_before = portal_log.stat().st_size
    job_id = submit_job(browser_platform, "alice", name="hybrid", consistency="hybrid", max_workers=1)
    alice = log_in(chromium, browser_platform, "alice")
    alice.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    # Once a step is in, both the scheduler's batch and the last step's are known.
    alice.wait_for_function(
        """() => [...document.querySelectorAll('#facts dt')].some((dt) => dt.textContent === 'Throughput'
             && /samples/.test(dt.nextElementSibling.textContent))""", timeout=120_000,
    )
    names, values = alice.locator("#facts dt").all_inner_texts(), alice.locator("#facts dd").all_inner_texts()
    assert names.count("Global batch") == 1, names
    assert re.fullmatch(r"\d+( at the last step; the scheduler chose \d+ for the next generation)?",
                        values[names.index("Global batch")]), values
    alice.locator("#job-devices td .sim").wait_for()
    assert not re.search(r"\b1 workers\b", alice.inner_text("main"))
    screenshot(alice, "job-hybrid-one-global-batch")

    alice.goto(f"{browser_platform.base_url}/jobs/new/")
    alice.select_option("#workload", "char-transformer")
    alice.fill("#hp-char-transformer-heads", "5")
    alice.click("button[type=submit] >> text=Submit")
    rule = alice.locator("#hp-char-transformer-error")
    rule.wait_for()
    assert rule.inner_text() == "d_model (64) must be a multiple of heads (5)" and rule.is_visible()
    screenshot(alice, "submit-rule-across-hyperparameters")

    bob = log_in(chromium, browser_platform, "bob")
    for path, status, reason, name in (
        (f"/jobs/{job_id}/", 403, f"Job {job_id} is not yours; only its owner and staff may see its page.", "error-403"),
        ("/jobs/99999/", 404, "There is no job 99999.", "error-404"),
    ):
        reply = bob.goto(browser_platform.base_url + path)
        assert reply is not None and reply.status == status
        assert bob.inner_text("#error-reason") == reason
        assert bob.locator("nav[aria-label=Main] >> text=Jobs").is_visible()
        bob.wait_for_selector("#conn-state[data-state=live]")
        screenshot(bob, name)
    reply = bob.goto(f"{browser_platform.base_url}/jobs/?owner=nobody")
    assert reply is not None and reply.status == 400
    assert bob.inner_text("#owner-error") == "There is no user named “nobody”."
    screenshot(bob, "jobs-filter-no-such-owner")
    bob.wait_for_selector("#conn-state[data-state=live]")
    bob.context.close()  # a closed tab: its socket goes away
    alice.context.close()
    cancel_all(browser_platform, "alice")

    def logged_since() -> str:
        with portal_log.open("rb") as log:
            log.seek(logged_before)
            return log.read().decode(errors="replace")

    browser_platform.wait_for("the closed sockets in the log", lambda: logged_since().count("live socket of") >= 2)
    log = logged_since()
    assert f"Forbidden (Permission denied): /jobs/{job_id}/ (job {job_id} is not yours" in log
    assert "Traceback" not in log, log
