"""The real `python -m agent` process against a small portal stand-in (http.server in a thread
that records what it is sent) and the real Redis of this machine (db 15): registration,
periodic reports, commands on the node's stream, workers, the portal going away, a refused
token, and a graceful stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from agent.commands import COMMAND_FIELD
from elastic.wire import (
    AgentReport,
    LaunchCommand,
    NodeRegistration,
    RegistrationReply,
    SimulateOwnerCommand,
    WorkerAssignment,
    command_stream,
)

pytestmark = pytest.mark.slow

REDIS_URL = "redis://127.0.0.1:6379/15"
TOKEN = "agent-test-token"
ROOT = Path(__file__).resolve().parent.parent


class FakePortal:
    """The agent API of the portal: answers registrations and records reports. `available`
    False answers 503; `unknown_node_reports` answers that many reports with the portal's
    409 unknown_node; `during_registration` is called before a registration is answered."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.registrations: list[NodeRegistration] = []
        self.reports: list[AgentReport] = []
        self.attempts = 0
        self.available = True
        self.unknown_node_reports = 0
        self.during_registration: Callable[[], None] | None = None
        self.headers: list[str] = []
        self._lock = threading.Lock()
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                portal.headers.append(self.headers.get("Authorization", ""))
                status, answer = portal.answer(self.path, self.headers.get("Authorization"), body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, authorization: str | None, body: bytes) -> tuple[int, Any]:
        if authorization != f"Bearer {TOKEN}":
            return 401, {"error": {"status": 401, "code": "unauthorized", "message": "unknown agent token"}}
        with self._lock:
            if path == "/api/agent/register":
                self.attempts += 1
                if not self.available:
                    return 503, {"error": {"status": 503, "code": "unavailable", "message": "starting"}}
                if self.during_registration is not None:
                    self.during_registration()
                self.registrations.append(NodeRegistration.model_validate_json(body))
                reply = RegistrationReply(
                    node_id=len(self.registrations),
                    commands_redis_url=REDIS_URL,
                    commands_stream=command_stream(self.node),
                    report_interval_s=0.2,
                )
                return 200, reply.model_dump(mode="json")
            if path == "/api/agent/report":
                if not self.available:
                    return 503, {"error": {"status": 503, "code": "unavailable", "message": "down"}}
                if self.unknown_node_reports:
                    self.unknown_node_reports -= 1
                    message = f"node {self.node!r} has not registered; register first"
                    return 409, {"error": {"status": 409, "code": "unknown_node", "message": message}}
                self.reports.append(AgentReport.model_validate_json(body))
                return 200, {"ok": True}
        return 404, {"error": {"status": 404, "code": "not_found", "message": path}}

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = predicate()
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def latest_sample(self, index: int) -> Any:
        for report in reversed(self.reports):
            for sample in report.samples:
                if sample.index == index:
                    return sample
        return None

    def events(self) -> list[Any]:
        return [event for report in self.reports for event in report.events]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AgentProcess:
    def __init__(self, portal_url: str, node: str, log: Path, token: str = TOKEN, *extra: str) -> None:
        self.log = log
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "--portal",
                portal_url,
                "--token",
                token,
                "--name",
                node,
                "--backend",
                "simulated",
                "--devices",
                "2",
                "--stop-grace",
                "5",
                "--worker-module",
                "tests.agent_fake_worker",
                *extra,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self, timeout_s: float = 20.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def node() -> Iterator[str]:
    name = f"agent-test-{uuid.uuid4().hex[:8]}"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(command_stream(name))


@pytest.fixture
def portal(node: str) -> Iterator[FakePortal]:
    portal = FakePortal(node)
    yield portal
    portal.close()


@pytest.fixture
def start_agent(portal: FakePortal, node: str, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(*extra: str, token: str = TOKEN) -> AgentProcess:
        state = ("--state-dir", str(tmp_path / "state"))
        agent = AgentProcess(portal.url, node, tmp_path / f"agent-{len(started)}.log", token, *state, *extra)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()


def send(node: str, command: Any) -> None:
    text = command if isinstance(command, str) else command.model_dump_json()
    redis.Redis.from_url(REDIS_URL).xadd(command_stream(node), {COMMAND_FIELD: text})


def owner(index: int, present: bool = True) -> SimulateOwnerCommand:
    return SimulateOwnerCommand(device_index=index, present=present)


def worker_launch(**spec: Any) -> LaunchCommand:
    return LaunchCommand(
        job_id=11,
        generation=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=[WorkerAssignment(rank=0, device_index=0)],
        spec=spec,
        run_dir="/tmp/bungee-agent-test",
        coordination_key="bungee-agent-test:job:11",
        redis_url=REDIS_URL,
    )


@pytest.mark.parametrize("redis_override", [False, True], ids=["portal-redis", "redis-url-flag"])
def test_registers_reports_and_follows_its_commands(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess], redis_override: bool
) -> None:
    send(node, owner(1))  # from before the agent started: must not be replayed
    portal.during_registration = lambda: send(node, owner(0))  # sent while registering: must arrive
    agent = start_agent(*(["--redis-url", REDIS_URL] if redis_override else []))

    [registration] = portal.wait_for(lambda: portal.registrations, "the registration")
    assert (registration.name, registration.address, registration.backend) == (node, "127.0.0.1", "simulated")
    assert [(d.index, d.kind) for d in registration.devices] == [(0, "cpu-slot"), (1, "cpu-slot")]
    assert set(portal.headers) == {f"Bearer {TOKEN}"}

    portal.wait_for(lambda: len(portal.reports) >= 3, "three reports")
    assert all(r.node == node and [s.index for s in r.samples] == [0, 1] for r in portal.reports)
    portal.wait_for(lambda: portal.latest_sample(0).owner_present, "the owner sent during registration")
    assert not portal.latest_sample(1).owner_present

    send(node, "not a command")
    redis.Redis.from_url(REDIS_URL).xadd(command_stream(node), {"other": "field"})
    send(node, owner(1))
    portal.wait_for(lambda: portal.latest_sample(1).owner_present, "device 1's owner")
    # The sample that shows the owner may still list the device's standby, ours (it goes next).
    [owner_process] = [p for p in portal.latest_sample(1).processes if not p.ours]
    assert (owner_process.name, owner_process.ours) == ("owner", False)
    send(node, owner(0, present=False))
    portal.wait_for(lambda: not portal.latest_sample(0).owner_present, "device 0's owner to leave")

    assert agent.stop() == 0
    assert "skipping entry" in agent.stderr()


def test_runs_a_worker_and_stops_it_on_sigterm(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    """With --on-term stop, as before the drain (agent.drain; test_agent_drain) was the default."""
    agent = start_agent("--on-term", "stop")
    portal.wait_for(lambda: portal.reports, "a first report")
    send(node, worker_launch(busy=True, step_s=0.05))

    [running] = portal.wait_for(lambda: portal.reports[-1].running, "a running worker")
    assert (running.job_id, running.generation, running.rank, running.device_index) == (11, 1, 0, 0)
    portal.wait_for(lambda: portal.latest_sample(0).utilization_pct > 10, "the worker's load on slot 0")
    [process] = portal.latest_sample(0).processes
    assert (process.pid, process.ours, process.job_id) == (running.pid, True, 11)
    portal.wait_for(lambda: any(e.kind == "progress" for e in portal.events()), "progress")

    assert agent.stop() == 0
    events = portal.events()
    kinds = [e.kind for e in events]
    assert kinds[0] == "started" and kinds.count("started") == 1
    [exited] = [e for e in events if e.kind == "exited"]
    assert (exited.pid, exited.exit_code, exited.reason) == (running.pid, 75, "stopped")
    with pytest.raises(ProcessLookupError):
        os.kill(running.pid, 0)


def test_a_killed_agent_leaves_its_worker_training_and_the_next_one_takes_it_back(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = start_agent()
    portal.wait_for(lambda: portal.reports, "a first report")
    exit_file = tmp_path / "exit-now"
    send(node, worker_launch(steps=1_000_000, step_s=0.02, exit_file=str(exit_file)))
    [running] = portal.wait_for(lambda: portal.reports[-1].running, "a running worker")
    portal.wait_for(lambda: any(e.kind == "progress" for e in portal.events()), "progress")
    agent.kill()
    worker = psutil.Process(running.pid)
    try:
        assert worker.status() != psutil.STATUS_ZOMBIE, "the worker died with its agent"
        seen = len(portal.events())
        successor = start_agent()
        [again] = portal.wait_for(lambda: portal.registrations[1:], "the second agent's registration")
        assert again.running == [running], "it registers with the worker it took back"
        portal.wait_for(lambda: portal.reports[-1].running == [running], "the worker in its reports")
        portal.wait_for(
            lambda: [e for e in portal.events()[seen:] if e.kind == "progress"], "the worker's progress"
        )
        exit_file.touch()
        [exited] = portal.wait_for(
            lambda: [e for e in portal.events()[seen:] if e.kind == "exited"], "the worker's exit"
        )
        assert (exited.pid, exited.exit_code, exited.reason) == (running.pid, 0, "completed")
        assert "started" not in [e.kind for e in portal.events()[seen:]]
        assert successor.stop() == 0
    finally:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass


def test_waits_for_the_portal_and_keeps_events_while_it_is_away(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    portal.available = False
    agent = start_agent()
    portal.wait_for(lambda: portal.attempts >= 2, "a second registration attempt")
    assert agent.process.poll() is None
    portal.available = True
    portal.wait_for(lambda: portal.reports, "a first report")

    portal.available = False
    send(node, worker_launch(steps=3, step_s=0.01))
    time.sleep(1.5)  # the worker starts, runs and exits while reports are refused
    assert agent.process.poll() is None
    portal.available = True
    portal.wait_for(lambda: any(e.kind == "exited" for e in portal.events()), "the worker's exit")
    assert [e.kind for e in portal.events() if e.kind != "log"] == [
        "started",
        "progress",
        "progress",
        "progress",
        "exited",
    ]
    assert "reporting to the portal failed" in agent.stderr()
    assert agent.stop() == 0


def test_reports_while_redis_is_away_and_reads_commands_once_it_is_up(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    agent = start_agent("--redis-url", f"redis://127.0.0.1:{port}/0")
    portal.wait_for(lambda: len(portal.reports) >= 3, "reports without Redis")
    server = subprocess.Popen(
        [str(ROOT / ".venv/bin/redis-server"), "--port", str(port), "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        late = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        deadline = time.monotonic() + 10
        while True:
            try:
                late.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        late.xadd(command_stream(node), {COMMAND_FIELD: owner(1).model_dump_json()})
        portal.wait_for(lambda: portal.latest_sample(1).owner_present, "the command sent once Redis was up")
        assert "cannot read commands" in agent.stderr()
        assert agent.stop() == 0
    finally:
        server.terminate()
        server.wait()


def test_registers_again_when_the_portal_has_forgotten_the_node(
    portal: FakePortal, start_agent: Callable[..., AgentProcess]
) -> None:
    portal.unknown_node_reports = 1
    agent = start_agent()
    portal.wait_for(lambda: len(portal.registrations) == 2, "a second registration")
    portal.wait_for(lambda: portal.reports, "a report after registering again")
    assert agent.stop() == 0


def test_a_refused_token_exits_2_saying_so(
    portal: FakePortal, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(token="wrong-token")
    assert agent.process.wait(timeout=20) == 2
    stderr = agent.stderr()
    assert "401" in stderr and "token was refused" in stderr and "unknown agent token" in stderr
    assert portal.registrations == []


def test_sigterm_while_waiting_for_the_portal_exits_0(
    portal: FakePortal, start_agent: Callable[..., AgentProcess]
) -> None:
    portal.available = False
    agent = start_agent()
    portal.wait_for(lambda: portal.attempts >= 1, "a registration attempt")
    assert agent.stop() == 0
