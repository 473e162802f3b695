"""Pages say which samples they show, in real Chromium: the job page asks for its job's devices
alone and still shows their readings live; the board, with every node's rows on screen, asks
for every node. (What the portal sends for each subscription: test_live_sample_subscriptions.)"""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser_support import cancel_all, log_in, submit_job

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
