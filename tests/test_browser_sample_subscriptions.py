"""Pages say which samples they show, in real Chromium: the job page asks for its job's devices
alone and still shows their readings live; the board, with every node's rows on screen, asks
for every node. (What the portal sends for each subscription: test_live_sample_subscriptions.)"""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import HeldSocket, cancel_all, log_in, submit_job

pytestmark = [pytest.mark.slow, pytest.mark.browser]


RECORD_SENT = """
window.sentOnSockets = [];
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) { window.sentOnSockets.push(JSON.parse(data)); return send.call(this, data); };
"""
SUBSCRIPTIONS = "() => window.sentOnSockets.filter((m) => m.action === 'subscribe_samples')"


def test_the_job_page_follows_its_devices_and_the_board_every_node(browser_platform: Any, chromium: Any) -> None:
    job_id = submit_job(browser_platform, "alice", name="followed", max_workers=1)
    api = browser_platform.api("alice")
    devices = browser_platform.wait_for("the job's devices", lambda: sorted(
        a["device_id"] for a in api.get(f"/api/jobs/{job_id}").json()["allocations"]), timeout_s=90)

    page = log_in(chromium, browser_platform, "alice")
    page.add_init_script(RECORD_SENT)
    page.reload()
    page.wait_for_function(f"() => ({SUBSCRIPTIONS})().length > 0", timeout=30_000)
    assert page.evaluate(SUBSCRIPTIONS) == [{"action": "subscribe_samples", "all": True}], "every node's rows on screen"

    page.goto(f"{browser_platform.base_url}/jobs/{job_id}/")
    page.wait_for_function(
        f"(ids) => ({SUBSCRIPTIONS})().some((m) => JSON.stringify(m.device_ids) === JSON.stringify(ids))",
        arg=devices, timeout=30_000,
    )
    assert not any(m.get("all") for m in page.evaluate(SUBSCRIPTIONS)), "the job page never asks for every node"
    page.wait_for_function(
        "() => [...document.querySelectorAll('#job-devices tbody tr td:last-child')].some((td) => td.textContent.endsWith('%'))",
        timeout=30_000,
    )
    cancel_all(browser_platform, "alice")


# The board's subscription waits 100 ms after its rows move on screen; these timers are held
# until the test fires them, and firing is armed to happen right after the devices table is
# redrawn: as under load, where the timer comes due before the page's next frame has told the
# board which of the new rows are on screen.
HELD_TIMERS = """
window.heldTimers = new Map();
let nextHeld = 1e6;
const realSetTimeout = window.setTimeout, realClearTimeout = window.clearTimeout;
window.setTimeout = function (fn, delay, ...rest) {
  if (delay !== 100) return realSetTimeout.call(window, fn, delay, ...rest);
  const id = nextHeld++;
  window.heldTimers.set(id, fn);
  return id;
};
window.clearTimeout = function (id) { if (!window.heldTimers.delete(id)) realClearTimeout.call(window, id); };
window.fireHeldTimers = () => {
  const due = [...window.heldTimers.values()];
  window.heldTimers.clear();
  due.forEach((fn) => fn());
};
window.fireOnRedraw = false;
document.addEventListener("DOMContentLoaded", () => {
  new MutationObserver(() => { if (window.fireOnRedraw) { window.fireOnRedraw = false; window.fireHeldTimers(); } })
    .observe(document.querySelector("#devices tbody"), { childList: true });
});
"""


def test_a_redraw_while_the_boards_subscription_waits_does_not_subscribe_it_to_nothing(
        browser_platform: Any, chromium: Any) -> None:
    """The board draws its rows from the page, then again from the socket's snapshot. A redraw
    forgets which rows were on screen until the next frame says again; a subscription still
    waiting from the first drawing must not go out in between, as one for no node at all (the
    page would get no readings until its rows moved)."""
    page = log_in(chromium, browser_platform, "alice")
    page.add_init_script(RECORD_SENT + HELD_TIMERS)
    socket = HeldSocket(page)
    page.goto(browser_platform.base_url + "/")
    page.wait_for_function("() => window.heldTimers.size > 0", timeout=30_000)  # the first drawing's rows seen
    assert socket.snapshot_held(), "the portal sent its snapshot"
    page.evaluate("() => { window.fireOnRedraw = true; }")
    socket.release()
    page.wait_for_function("() => !window.fireOnRedraw", timeout=30_000)  # redrawn, and the due timers fired
    page.wait_for_function("() => window.heldTimers.size > 0", timeout=30_000)  # the redrawn rows seen
    page.evaluate("() => window.fireHeldTimers()")
    page.wait_for_function(f"() => ({SUBSCRIPTIONS})().length > 0", timeout=30_000)
    assert page.evaluate(SUBSCRIPTIONS) == [{"action": "subscribe_samples", "all": True}]

