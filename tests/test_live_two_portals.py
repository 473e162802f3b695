"""Two portal processes on one address (portal.launcher.portal_command: uvicorn's workers)
share the Redis channel layer: a socket served by either gets the samples that whichever
process ingested the agent's report sent, and the job events of an API call that either
answered. The real platform: PostgreSQL, Redis, Celery, an agent."""

from __future__ import annotations

from pathlib import Path

import psutil

from tests.conftest import VALID_SPEC
from tests.platform import Platform, SocketRecorder, running_platform

MAX_SOCKETS = 24


def serving_process(platform: Platform, socket: SocketRecorder) -> int | None:
    """The pid of the portal worker holding the other end of `socket`'s connection."""
    portal = psutil.Process(next(p for p in platform.group.processes if p.name == "portal").process.pid)
    for worker in portal.children():
        for connection in worker.net_connections(kind="tcp"):
            if connection.raddr and connection.raddr.port == socket.local_port and connection.status == "ESTABLISHED":
                return int(worker.pid)
    return None


def test_sockets_on_either_portal_process_get_every_update(tmp_path: Path) -> None:
    with running_platform(tmp_path, {"node-a": 2}, portal_processes=2) as platform:
        url = platform.base_url.replace("http", "ws") + "/ws/live/"
        sockets: list[SocketRecorder] = []
        served_by: dict[int, SocketRecorder] = {}
        try:
            # The kernel picks the process that accepts; open sockets until both serve one.
            while len(served_by) < 2:
                assert len(sockets) < MAX_SOCKETS, f"{len(sockets)} sockets, all on one process: {list(served_by)}"
                socket = SocketRecorder(url, platform.tokens["alice"]).start()
                sockets.append(socket)
                pid = platform.wait_for("the socket open", lambda s=socket: serving_process(platform, s), timeout_s=30)
                served_by.setdefault(pid, socket)
            for socket in served_by.values():
                platform.wait_for("samples on the socket", lambda s=socket: s.of_type("samples"), timeout_s=30)

            job_id = platform.api("alice").post("/api/jobs", json=VALID_SPEC).json()["id"]
            for socket in served_by.values():
                platform.wait_for("the new job on the socket", lambda s=socket: any(
                    job["id"] == job_id for job in s.job_states()), timeout_s=30)
            assert all(s.error is None for s in sockets), [s.error for s in sockets]
        finally:
            for socket in sockets:
                socket.stop()
