"""Real Chromium (Debian's /usr/bin/chromium) driven by Playwright against the real platform.
Screenshots go to test-output/screenshots/ so that people can look at them after a run."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, Page

from tests.platform import Platform

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "test-output" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic",
]
AXE = ROOT / "tests" / "browser" / "node_modules" / "axe-core" / "axe.min.js"


def log_in(browser: Browser, platform: Platform, user: str, **context: Any) -> Page:
    page = browser.new_context(**context).new_page()
    page.goto(platform.base_url + "/login/")
    page.fill("#id_username", user)
    page.fill("#id_password", f"{user}-pass")
    page.click("button[type=submit]")
    page.wait_for_url(platform.base_url + "/")
    page.wait_for_selector("#conn-state[data-state=live]")
    return page


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def axe_violations(page: Page) -> list[dict[str, Any]]:
    """Runs axe-core (WCAG 2 A and AA rules) on the page; returns its violations."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        "async () => await axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa']}})"
    )
    return [
        {"id": v["id"], "help": v["help"], "nodes": [n["html"][:120] for n in v["nodes"][:3]]}
        for v in result["violations"]
    ]


def submit_job(platform: Platform, user: str, **spec: Any) -> int:
    body = {"name": "browser-job", "workload": "digits-mlp", "min_workers": 1, "max_workers": 3,
            "steps": 1_000_000, **spec}
    reply = platform.api(user).post("/api/jobs", json=body)
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def cancel_all(platform: Platform, user: str) -> None:
    client = platform.api(user)
    for job in client.get("/api/jobs", params={"owner": user}).json():
        if job["state"] in {"queued", "running", "resizing"}:
            client.post(f"/api/jobs/{job['id']}/cancel")


def free_the_cluster(platform: Platform) -> None:
    """Cancels every user's live jobs and waits until no device is held: the state each browser
    test starts from on the shared platform, whatever the test before it left behind."""
    users = [name for name in platform.tokens if not name.startswith("agent-")]
    for user in users:
        cancel_all(platform, user)

    def free() -> bool:
        nodes = platform.api(users[0]).get("/api/cluster").json()["nodes"]
        return all(device["job"] is None for node in nodes for device in node["devices"])

    platform.wait_for("every device free", free, timeout_s=120)


class HeldSocket:
    """Holds back every message the portal sends on the page's live socket until `release`
    (Playwright's route_web_socket: the page's socket opens, its messages wait)."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.holding = True
        self.held: list[tuple[Any, Any]] = []
        page.route_web_socket(re.compile(r"/ws/live/$"), self._route)

    def _route(self, socket: Any) -> None:
        server = socket.connect_to_server()

        def from_server(message: Any) -> None:
            if self.holding:
                self.held.append((socket, message))
            else:
                socket.send(message)

        server.on_message(from_server)

    def snapshot_held(self, timeout_s: float = 30) -> bool:
        """Waits (the page's handlers run while it is waited on) until the snapshot is held."""
        deadline = time.monotonic() + timeout_s
        while not any('"type":"cluster"' in message for _, message in self.held):
            if time.monotonic() > deadline:
                return False
            self.page.wait_for_timeout(50)
        return True

    def release(self) -> None:
        self.holding = False
        for socket, message in self.held:
            socket.send(message)
