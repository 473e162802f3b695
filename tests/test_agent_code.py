"""The agent's copies of jobs' code (agent.code) against a real HTTP server on loopback standing
in for the portal's code endpoint: fetched once per digest, checked against it (a wrong archive
is refused and nothing is kept), unpacked per job, and a refusal is a failed start, not a crash.
The model a job starts from (init_from) is fetched the same way, once per job, and checked
against the digest the portal states for it."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import PortalClient
from agent.code import CodeCache, CodeUnavailable
from elastic.codepack import repack
from tests.code_support import RINGS, directory_files, tar_gz


def canonical(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    repack(io.BytesIO(tar_gz(files)), out, 10**8, 1000)
    return out.getvalue()


class CodeServer(http.server.ThreadingHTTPServer):
    """Serves `archives[digest]` at /api/agent/code/<digest>; counts requests."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.archives: dict[str, bytes] = {}
        self.models: dict[str, tuple[bytes, str]] = {}
        """job id -> (the model it starts from, the digest the portal states for it)"""
        self.requests: list[str] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: CodeServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.server.requests.append(self.path)
        headers: dict[str, str] = {}
        if self.path.endswith("/initial-model"):
            body, stated = self.server.models.get(self.path.split("/")[-2], (None, ""))
            headers["X-Bungee-Sha256"] = stated
        else:
            body = self.server.archives.get(self.path.rsplit("/", 1)[-1])
        if body is None:
            payload = b'{"error": {"status": 403, "code": "forbidden", "message": "no job on node-a runs it"}}'
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[CodeServer]:
    running = CodeServer()
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()


def cache_for(server: CodeServer, state_dir: Path) -> CodeCache:
    host, port = server.server_address[:2]
    return CodeCache(PortalClient(f"http://{host!s}:{port}", "agent-token"), state_dir)


def test_fetched_once_checked_and_unpacked_per_job(server: CodeServer, tmp_path: Path) -> None:
    archive = canonical(directory_files(RINGS))
    digest = hashlib.sha256(archive).hexdigest()
    server.archives[digest] = archive
    cache = cache_for(server, tmp_path)
    one = cache.prepare(1, digest)
    two = cache.prepare(2, digest)
    again = cache.prepare(1, digest)
    assert one != two and one == again
    assert (one / "task.py").read_bytes() == (RINGS / "task.py").read_bytes()
    assert (two / "points.csv").exists()
    assert len(server.requests) == 1, "one fetch per digest"


def test_an_archive_that_is_not_its_digest_is_refused(server: CodeServer, tmp_path: Path) -> None:
    wanted = canonical({"task.py": b"honest = True\n"})
    digest = hashlib.sha256(wanted).hexdigest()
    server.archives[digest] = canonical({"task.py": b"honest = False\n"})
    cache = cache_for(server, tmp_path)
    with pytest.raises(CodeUnavailable, match=f"refused code {digest}: what the portal sent has sha256"):
        cache.prepare(1, digest)
    assert not list((tmp_path / "code").iterdir()), "nothing of it is kept"
    assert not (tmp_path / "jobs" / "job-1" / "code").exists()


def test_a_refusal_by_the_portal_is_code_unavailable(server: CodeServer, tmp_path: Path) -> None:
    digest = "0" * 64
    with pytest.raises(CodeUnavailable, match="no job on node-a runs it"):
        cache_for(server, tmp_path).prepare(1, digest)


def test_the_model_a_job_starts_from_is_fetched_once_and_checked(server: CodeServer, tmp_path: Path) -> None:
    weights = b"a state dict" * 1000
    server.models["7"] = (weights, hashlib.sha256(weights).hexdigest())
    server.models["8"] = (weights, hashlib.sha256(b"something else").hexdigest())
    cache = cache_for(server, tmp_path)
    path = cache.initial_model(7)
    assert path.read_bytes() == weights and cache.initial_model(7) == path
    assert server.requests == ["/api/agent/jobs/7/initial-model"], "fetched once per job"
    with pytest.raises(CodeUnavailable, match="refused the model job 8 starts from"):
        cache.initial_model(8)
    with pytest.raises(CodeUnavailable, match="no job on node-a runs it"):
        cache.initial_model(9)
    assert sorted(p.name for p in (tmp_path / "jobs").rglob("*") if p.is_file()) == ["initial-model.pt"]


def test_a_jobs_files_go_once_it_has_been_gone_a_while(server: CodeServer, tmp_path: Path) -> None:
    archive = canonical(directory_files(RINGS))
    digest = hashlib.sha256(archive).hexdigest()
    server.archives[digest] = archive
    cache = cache_for(server, tmp_path)
    for job_id in (1, 2, 3):
        cache.prepare(job_id, digest)
    hour_ago = time.time() - 3700
    for job_id in (1, 2):
        os.utime(tmp_path / "jobs" / f"job-{job_id}", (hour_ago, hour_ago))
    assert cache.sweep(live_jobs={2}, kept_s=3600) == [1], "job 2 still runs here; job 3 was just prepared"
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["job-2", "job-3"]
    assert (tmp_path / "code" / f"{digest}.tar.gz").exists(), "the archive stays for the next job"
    assert cache.prepare(1, digest).is_dir(), "a job that comes back gets its copy again"
