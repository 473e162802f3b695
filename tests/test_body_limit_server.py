"""A body over its limit is refused before it is read by the real server the platform runs
(portal.launcher.portal_command, uvicorn), not only by the ASGI application driven in the test
process (tests/test_body_limit.py): an anonymous `POST /api/jobs` declaring 2 GiB gets its 413,
in the API's error shape, while the client has sent a few chunks of the body at most, and the
server closes the connection. Under daphne, which read a whole body before the application saw
the request, the same upload had no answer at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.body_limit_support import lying_upload
from tests.platform import running_portal

pytestmark = pytest.mark.slow

DECLARED = 2**31
MAX_SENT = 1024 * 1024


def test_a_lying_content_length_is_refused_before_the_body_is_read(tmp_path: Path) -> None:
    with running_portal(tmp_path) as portal:
        upload = lying_upload(portal.base_url, "/api/jobs", DECLARED, max_body_bytes=MAX_SENT, within_s=16)
        log = portal.group.tail("portal")
    assert upload.answered_after_s is not None, (
        f"no answer after {upload.body_bytes_sent} bytes of the declared {DECLARED} were sent over 16 s\n{log}"
    )
    assert upload.body_bytes_sent < MAX_SENT
    assert upload.status == 413, (upload.status, upload.body[:300])
    assert upload.headers is not None and upload.headers["content-type"] == "application/json"
    error = upload.error()
    assert error["status"] == 413 and error["code"] == "too_large"
    assert f"{DECLARED} bytes" in error["message"]
    assert upload.closed in ("eof", "reset"), "the server closed the connection rather than read on"
