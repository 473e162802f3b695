"""/api/docs in real Chromium with every request that is not to the portal refused, as on a
machine without internet: Swagger UI comes from the portal itself (npm's swagger-ui-dist in
static/vendor, installed by the Makefile like uPlot) and lists the operations."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.browser_support import log_in, screenshot

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_api_docs_work_offline(browser_platform: Any, chromium: Any) -> None:
    page = log_in(chromium, browser_platform, "alice")
    portal = urlsplit(browser_platform.base_url).netloc
    refused: list[str] = []
    served: list[str] = []

    def only_the_portal(route: Any) -> None:
        if urlsplit(route.request.url).netloc == portal:
            served.append(urlsplit(route.request.url).path)
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.context.route("**/*", only_the_portal)
    page.goto(browser_platform.base_url + "/api/docs")
    page.locator(".opblock-summary-path", has_text="/api/jobs").first.wait_for(timeout=20_000)
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    assert len(paths) > 10 and any("/api/jobs/{job_id}/resize" in p.replace("\u200b", "") for p in paths)
    assert refused == [], f"the page asked the internet for {refused}"
    assert "/static/vendor/node_modules/swagger-ui-dist/swagger-ui-bundle.js" in served, served
    screenshot(page, "api-docs-offline")
