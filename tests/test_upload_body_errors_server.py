"""The multipart faults of tests/test_upload_body_errors.py sent to the real platform's server
(portal.launcher.portal_command), over a socket: every answer is in the API's error shape. An
empty multipart form (`--B--`, no part) got a 400 with no body when the platform ran daphne,
whose Twisted parses every multipart body itself before the application sees it and answers what
its parser refuses with a bare 400; uvicorn (portal.serve) hands every body to the application."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.platform import running_platform
from tests.test_upload_body_errors import CASES, MISSING

pytestmark = pytest.mark.slow


def test_every_answer_is_in_the_error_shape(tmp_path: Path) -> None:
    with running_platform(tmp_path, {}) as platform, httpx.Client(base_url=platform.base_url, timeout=30) as client:
        nodeless_agent = platform.group.run(
            "manage.py", "create_token", "alice", "--role", "agent", "--label", "no node").strip()
        wrong = []
        for endpoint, path, token in (("/api/code", "/api/code", platform.tokens["alice"]),
                                      ("artifacts", "/api/agent/jobs/1/artifacts", nodeless_agent)):
            for case, (content_type, body, status, code, _) in CASES.items():
                headers = {"Authorization": f"Bearer {token}"}
                if content_type is not None:
                    headers["Content-Type"] = content_type.encode("utf-8")  # type: ignore[assignment]
                reply = client.post(path, content=body, headers=headers)
                if not reply.headers.get("content-type", "").startswith("application/json"):
                    wrong.append(f"{path} {case}: {reply.status_code}, not in the shape: {reply.content[:100]!r}")
                    continue
                error = reply.json()["error"]
                if endpoint == "/api/code":
                    expected = (status, MISSING[endpoint][0] if code == "missing" else code)
                else:  # this agent's token serves no node: refused before the body is read
                    expected = (403, "forbidden")
                if (reply.status_code, error["status"], error["code"]) != (expected[0], *expected):
                    wrong.append(f"{path} {case}: {reply.status_code} {error}, not {expected}")
        assert wrong == [], "\n".join(wrong)
