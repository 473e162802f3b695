"""The real server the platform runs (uvicorn, portal.launcher.portal_command) reads no body before
it knows who sends it: an anonymous 2 GiB body, declared or chunked, to each route that takes an
upload (the artifacts of a job that exists and of one that does not, a code upload, the submit
page) and to a path that is no route, is answered while the client has sent nothing but the
headers; streamed for real, it is refused after a few chunks at most and the connection closed;
and no temporary file is left behind."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.body_limit_support import lying_upload, stalled_upload
from tests.conftest import VALID_SPEC
from tests.platform import running_portal, seed_users

pytestmark = pytest.mark.slow

DECLARED = 2 * 1024**3
STREAMED = 4 * 1024 * 1024


def files_under(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file()}


def test_an_anonymous_2gib_body_is_refused_unread_on_every_upload_route(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with running_portal(tmp_path, extra_env={"TMPDIR": str(temporary)}) as portal:
        alice = seed_users(portal.group, [])["alice"]
        job = httpx.post(f"{portal.base_url}/api/jobs", json=VALID_SPEC, headers={"Authorization": f"Bearer {alice}"})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        before = files_under(temporary) | files_under(tmp_path / "data")
        routes = {
            f"/api/agent/jobs/{job_id}/artifacts": 401, f"/api/agent/jobs/{job_id + 1000}/artifacts": 401,
            "/api/code": 401, "/jobs/new/": 401, "/api/agent/jobs/x/artifacts": 404, "/nowhere/at/all": 404,
        }
        for path, status in routes.items():
            for declared in (DECLARED, None):
                where = f"{path}, {'declared' if declared else 'chunked'}"
                unsent = stalled_upload(portal.base_url, path, declared, sent_bytes=0, within_s=15)
                assert unsent.status == status, (where, unsent, portal.group.tail("portal"))
                assert unsent.body_bytes_sent == 0, "answered with nothing of the body sent"
                assert unsent.headers is not None and unsent.headers["connection"] == "close"
                assert unsent.error()["status"] == status
                streamed = lying_upload(portal.base_url, path, declared, max_body_bytes=STREAMED, within_s=8)
                assert streamed.status == status, (where, streamed)
                assert streamed.body_bytes_sent < STREAMED, where
                assert streamed.closed in ("eof", "reset"), f"{where}: the server closed the connection, not read on"
        after = files_under(temporary) | files_under(tmp_path / "data")
    assert after - before == set(), "no temporary file is left"
