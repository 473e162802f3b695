"""The portal restarted under an open job page, in real Chromium: the page shows it is offline,
reconnects by itself once the portal is back, re-subscribes and fetches what it missed (here,
the job cancelled while it was away). The board and the job list, their socket away for a while,
catch up too, and a page says it is live only once its socket's snapshot is in. A socket closed
with 1013 (the portal's Redis or database away) waits the API's Retry-After. The board draws
the cluster from its render, before its socket says anything."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.browser_support import HeldSocket, log_in, screenshot, submit_job

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


def test_a_socket_closed_with_try_again_later_waits_as_the_api_asks(browser_platform: Any, chromium: Any) -> None:
    """While its Redis or database is away the portal accepts the page's socket and closes it
    with 1013 (portal.live.unavailable). The page says the portal is unavailable and waits the
    API's Retry-After (5 s) before it tries again; a socket that opened does not reset its
    backoff, only one whose snapshot came in (before, every accepted socket did, and the page
    retried after half a second). The next socket, let through, makes it live again."""
    platform = browser_platform
    page = log_in(chromium, platform, "alice")
    attempts: list[float] = []

    def route(socket: Any) -> None:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            socket.close(code=1013, reason="the portal's Redis is not answering; try again shortly")
        else:
            socket.connect_to_server()

    page.route_web_socket(re.compile(r"/ws/live/$"), route)
    page.reload()
    page.wait_for_function("() => document.getElementById('conn-state').textContent.startsWith('portal unavailable')",
                           timeout=30_000)
    assert page.locator("#conn-state").inner_text() == "portal unavailable — retrying in 5 s"
    assert page.locator("#conn-state").get_attribute("data-state") == "offline"
    page.wait_for_selector("#conn-state[data-state=live]", timeout=30_000)
    assert len(attempts) == 2, attempts
    # setTimeout never fires early; the margin is for the route callbacks' own delivery.
    assert attempts[1] - attempts[0] > 4, f"retried {attempts[1] - attempts[0]:.1f} s after a 1013"
    page.context.close()


@pytest.mark.parametrize("where", ["board", "job list"])
def test_a_page_whose_socket_was_away_catches_up(browser_platform: Any, chromium: Any, where: str) -> None:
    """The page's socket drops (the portal stays up) and is refused for a while; a job is
    cancelled meanwhile. Once the socket is back, the page shows it: the socket's snapshot, taken
    after it joined its groups, carries the active jobs (the board drops the job's row; the job
    list, not finding it active, reads its end from the list API)."""
    platform = browser_platform
    job_id = submit_job(platform, "alice", name="away", max_workers=1)
    page = log_in(chromium, platform, "alice")
    sockets: list[Any] = []
    open_to_server = True

    def route(socket: Any) -> None:
        if not open_to_server:
            socket.close()  # refused: the page retries after its backoff
            return
        socket.connect_to_server()
        sockets.append(socket)

    page.route_web_socket(re.compile(r"/ws/live/$"), route)
    if where == "board":
        page.reload()  # its socket through the route now
        row = page.locator(f'.job-row[data-job="{job_id}"]')
    else:
        page.goto(platform.base_url + "/jobs/")
        row = page.locator(f'#jobs tr[data-job="{job_id}"]')
    row.wait_for()
    page.wait_for_function("() => document.getElementById('conn-state').dataset.state === 'live'")
    assert sockets, "the page's socket did not go through the route"
    open_to_server = False
    sockets[-1].close()
    page.wait_for_selector("#conn-state[data-state=offline]", timeout=30_000)
    assert platform.api("alice").post(f"/api/jobs/{job_id}/cancel").status_code == 200
    platform.wait_for("the job cancelled", lambda: platform.job(job_id)["state"] == "cancelled")
    assert row.count() == 1 and "cancelled" not in row.inner_text(), "it heard of the cancel while away"
    open_to_server = True
    page.wait_for_selector("#conn-state[data-state=live]", timeout=30_000)
    if where == "board":
        row.wait_for(state="detached", timeout=30_000)
    else:
        state = row.locator('[data-field="state"]')
        page.wait_for_function(
            "(id) => document.querySelector(`#jobs tr[data-job=\"${id}\"] [data-field=state]`).textContent === 'cancelled'",
            arg=job_id, timeout=30_000,
        )
        assert state.inner_text() == "cancelled"
    page.context.close()


def test_the_page_says_live_only_once_its_snapshot_is_in(browser_platform: Any, chromium: Any) -> None:
    """"live" means the page is current: the socket open is not enough, the snapshot the portal
    sends on it must be in the page. Here the socket's messages are held back after it opened: the
    header says it is catching up, and says live only once they are let through."""
    platform = browser_platform
    job_id = submit_job(platform, "alice", name="held", max_workers=1)
    page = log_in(chromium, platform, "alice")
    socket = HeldSocket(page)
    page.reload()
    page.wait_for_selector(f'.job-row[data-job="{job_id}"]')
    page.wait_for_function("() => document.getElementById('conn-state').textContent === 'catching up…'",
                           timeout=30_000)
    assert socket.snapshot_held(), "the portal sent no snapshot on the page's socket"
    assert page.locator("#conn-state").get_attribute("data-state") == "connecting", "live before its snapshot"
    socket.release()
    page.wait_for_selector("#conn-state[data-state=live]", timeout=30_000)
    page.context.close()


def test_the_board_draws_the_cluster_before_its_socket_says_anything(browser_platform: Any, chromium: Any) -> None:
    """The board's render carries the cluster: with every message of its socket held back, the
    devices are listed and the job's bar is drawn on their track; the snapshot, let through, then
    leaves the job's row as it is (the first draw used to size every bar to one device, and the
    snapshot redrew them all)."""
    platform = browser_platform
    job_id = submit_job(platform, "alice", name="drawn", max_workers=1)
    cluster = platform.api("alice").get("/api/cluster").json()
    device_count = sum(len(node["devices"]) for node in cluster["nodes"])
    page = log_in(chromium, platform, "alice")
    page.wait_for_selector(f'.job-row[data-job="{job_id}"] .bar[data-workers="1"]')  # running, as the test wants
    socket = HeldSocket(page)
    page.reload()
    page.wait_for_selector(f'.job-row[data-job="{job_id}"]')
    assert page.locator("#devices tbody tr").count() == device_count, "the devices wait for the socket"
    page.evaluate(f"""() => {{ window.drawnRow = document.querySelector('.job-row[data-job="{job_id}"]'); }}""")
    assert socket.snapshot_held(), "the portal sent no snapshot on the page's socket"
    socket.release()
    page.wait_for_selector("#conn-state[data-state=live]", timeout=30_000)
    kept = page.evaluate(f"""() => window.drawnRow === document.querySelector('.job-row[data-job="{job_id}"]')""")
    assert kept, "the snapshot redrew the job's row, which had not changed"
    page.context.close()
