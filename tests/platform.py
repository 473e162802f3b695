"""The whole platform as real processes, for integration tests: a fresh PostgreSQL database,
the machine's Redis under a prefix of its own, the portal (uvicorn, portal.serve), a Celery
worker and beat, and agents with simulated devices. Tests talk to it only over HTTP and
WebSockets, as users and agents do."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import psycopg
import redis

from portal.launcher import ROOT, ProcessGroup, platform_commands, portal_command
from tests.netns import Network

POSTGRES_URL = os.environ.get("TEST_POSTGRES_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/12")
MASTER_PORT_LOW = 20000
EPHEMERAL_PORTS_START = 32768
TLS_CONTEXT = ssl.create_default_context()
"""One TLS context for every client the tests make: the platforms speak plain HTTP, but httpx
builds a context (loading the CA bundle) for each client it is not given one, about 23 ms of CPU,
and the tests' polls made a client each, several times a second."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Platform:
    base_url: str
    group: ProcessGroup
    tokens: dict[str, str]
    env: dict[str, str]
    commands: dict[str, list[str]] = field(default_factory=dict)
    """How the portal, the Celery worker and beat were started (portal.launcher)."""
    network: Network | None = None
    """Where each agent runs on a host of its own (tests.netns); None: all on this one."""

    def api(self, user: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.tokens[user]}"}, timeout=30,
            verify=TLS_CONTEXT,
        )

    def job(self, job_id: int, user: str = "alice") -> dict[str, Any]:
        """The job as `user` reads it through the API; any reply but 200 fails the test with the
        reply's text (a 503 read as a job had failed tests later as a KeyError, hiding it)."""
        with self.api(user) as client:
            reply = client.get(f"/api/jobs/{job_id}")
        assert reply.status_code == 200, f"job {job_id}: HTTP {reply.status_code}: {reply.text[:500]}"
        return reply.json()

    def start_agent(self, name: str, devices: int, on_term: str = "stop", *extra: str) -> None:
        """Starts node `name`'s agent with `devices` simulated devices and an agent token of its
        own, `tokens["agent-NAME"]`, made the first time (an agent token serves one node). Its
        SIGTERM stops its workers (`on_term`), as the platform's teardown wants; a test of the
        drain asks for "drain"; `extra` are more of its flags."""
        token = self.tokens.get(f"agent-{name}")
        if token is None:
            token = self.group.run(
                "manage.py", "create_token", "alice", "--role", "agent", "--label", f"agent of {name}"
            ).strip()
            self.tokens[f"agent-{name}"] = token
        token_file = self.group.log_dir / f"agent-{name}.token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
        command = [
            sys.executable, "-m", "agent", "--portal", self.base_url, "--token-file", str(token_file),
            "--name", name, "--devices", str(devices), "--backend", "simulated", "--on-term", on_term, *extra,
        ]
        if self.network is not None:
            command = [*self.network.prefix(name), *command, "--address", self.network.hosts[name].address]
        self.group.start(f"agent-{name}", command)

    def agent_may_leave(self, name: str) -> None:
        """Node `name`'s agent is about to be told to drain: it exits by itself once its workers
        have left (at once, these days), which `wait_for` must not take for a death."""
        [managed] = [p for p in self.group.processes if p.name == f"agent-{name}"]
        managed.ends_by_itself = True

    def kill_agent(self, name: str) -> None:
        """SIGKILLs the agent named `name`, as a crash would: its workers train on. The group
        forgets the process, so that `wait_for` does not take it for a failure; `start_agent`
        with the same name starts it again, on the same state directory."""
        self.kill(f"agent-{name}")

    def kill(self, name: str) -> None:
        """SIGKILLs the platform's process `name` ("worker", "beat", "agent-NAME"), as a crash
        would, and forgets it (so that `wait_for` does not take it for a failure)."""
        [managed] = [p for p in self.group.processes if p.name == name]
        managed.process.kill()
        managed.process.wait()
        managed.log_file.close()
        self.group.processes.remove(managed)

    def portal_answers(self) -> bool:
        try:
            return httpx.get(self.base_url + "/login/", timeout=1, verify=TLS_CONTEXT).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, name: str) -> None:
        """Starts the platform's process `name` ("portal", "worker" or "beat") again, as at the
        start."""
        self.group.platform_process(name, self.commands[name])

    def restart_agent(self, name: str, devices: int) -> None:
        """SIGKILLs the agent `name` (its workers, in sessions of their own, are not signalled)
        and starts it again as `start_agent` does, as a crashed agent that comes back would be.
        Its log goes on in the same file."""
        self.kill_agent(name)
        self.start_agent(name, devices)

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = 60, every_s: float = 0.3) -> Any:
        """Polls `check` until it returns something truthy; returns that. Fails with the
        platform's logs if it does not happen in time or a process died."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            dead = self.group.dead()
            if dead:
                raise AssertionError(f"{dead[0].name} died:\n{self.group.tail(dead[0].name)}")
            last = check()
            if last:
                return last
            time.sleep(every_s)
        logs = "\n".join(f"--- {p.name}\n{self.group.tail(p.name, 25)}" for p in self.group.processes)
        raise AssertionError(f"timed out waiting for {what}; last value {last!r}\n{logs}")


_SEED = """
import io, json
from django.core.management import call_command

def run(*args):
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue().strip()

tokens = {{}}
for user in ("alice", "bob"):
    run("ensure_user", user, "--password", user + "-pass")
    tokens[user] = run("create_token", user)
for name in {agents!r}:
    tokens["agent-" + name] = run("create_token", "alice", "--role", "agent", "--label", "agent of " + name)
print(json.dumps(tokens))
"""
"""Makes the users with their tokens and a token per agent, through
the project's own management commands, in one process (each `manage.py` start costs seconds on a
loaded machine); prints the tokens as JSON."""


def seed_users(group: ProcessGroup, agents: list[str]) -> dict[str, str]:
    """Makes alice and bob (passwords NAME-pass) with an API token each, and an agent token per
    name in `agents` ("agent-NAME"), in the database of `group`'s environment; returns the
    tokens by those names."""
    tokens: dict[str, str] = json.loads(
        group.run("manage.py", "shell", "--no-imports", "-c", _SEED.format(agents=sorted(agents)))
    )
    return tokens


PORTAL_USER_RIGHTS = ["~*", "&*", "+@all"]
"""The portal's Redis user makes the users of nodes and jobs (portal.redis_users), so it holds the
ACL commands, and with them every right: the deployments give it all (docs/operator/security.md)."""


@dataclass
class RedisServer:
    """A redis-server of a test's own (on `host`, keeping nothing on disk), which the test may kill
    and start again, empty, on the same port. As a deployment configures it: its default user
    off, the portal's user (`url`) made by its configuration, so that it is there after a
    restart; the portal makes the others."""

    host: str
    folder: Path
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(16))
    process: subprocess.Popen[bytes] | None = None
    user: str = "bungee-portal"

    @property
    def url(self) -> str:
        return f"redis://{self.user}:{self.password}@{self.host}:{self.port}/0"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--bind", self.host, "--port", str(self.port),
             "--user", "default", "off", "--user", self.user, "on", f">{self.password}", *PORTAL_USER_RIGHTS,
             "--save", "", "--appendonly", "no", "--dir", str(self.folder),
             "--logfile", str(self.folder / "redis.log")],  # fmt: skip
        )
        client = redis.Redis(
            host=self.host, port=self.port, username=self.user, password=self.password, socket_connect_timeout=1
        )
        deadline = time.monotonic() + 10
        while not _answers(client):
            log = (self.folder / "redis.log").read_text() if (self.folder / "redis.log").exists() else ""
            assert time.monotonic() < deadline, f"redis-server on {self.host}:{self.port} did not come up:\n{log}"
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: everything it held is gone."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def redis_server(host: str, folder: Path) -> Iterator[RedisServer]:
    server = RedisServer(host, folder)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.kill()


_template: str | None = None
_template_lock = threading.Lock()


def migrated_template() -> str:
    """The name of a database migrated once in this test process, which every platform's database
    is made from (CREATE DATABASE ... TEMPLATE copies its files): migrating a fresh database took
    about a second more than a Django start a platform, more under load. Made at the first call,
    from this checkout's migrations, so it is never stale; dropped when the process exits."""
    global _template
    with _template_lock:
        if _template is None:
            name = f"bungee_it_template_{uuid.uuid4().hex[:10]}"
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{name}"')
            atexit.register(_drop_database, name)
            env = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "portal.settings",
                "DATABASE_URL": POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}",
                "SECRET_KEY": secrets.token_urlsafe(50),
            }
            migrate = [sys.executable, "manage.py", "migrate", "--noinput", "--verbosity", "0"]
            done = subprocess.run(migrate, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"migrating the template database failed:\n{done.stdout}{done.stderr}"
            _template = name
        return _template


def _drop_database(name: str) -> None:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def platform_database() -> Iterator[str]:
    """A fresh database made from the migrated template (migrated_template); its URL. Dropped
    at the end."""
    database = f"bungee_it_{uuid.uuid4().hex[:10]}"
    template = migrated_template()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}" TEMPLATE "{template}"')
    try:
        yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{database}"
    finally:
        _drop_database(database)


@contextmanager
def portal_redis_user(prefix: str) -> Iterator[str]:
    """The portal's own user on the machine's Redis (whose password-less default user the tests
    take as the admin that a deployment's configuration is), named under the platform's Redis
    prefix so that parallel runs never share one; its URL. Removed at the end with every user the
    portal made under that prefix (its nodes' and jobs')."""
    admin = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    password = secrets.token_hex(16)
    user = f"{prefix}:portal"
    admin.acl_setuser(user, enabled=True, reset=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                      commands=["+@all"])
    try:
        parts = urlsplit(REDIS_URL)
        yield urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{password}@{parts.netloc.rpartition('@')[2]}"))
    finally:
        made = [name for name in admin.acl_users() if name.startswith(f"{prefix}:")]
        admin.acl_deluser(*made)
        admin.close()


@contextmanager
def platform_redis(env: dict[str, str], extra_env: dict[str, str] | None) -> Iterator[None]:
    """Sets `env`'s REDIS_URL to the portal's own user on the machine's Redis, unless the test
    gave a Redis of its own (`extra_env`'s REDIS_URL)."""
    if extra_env and "REDIS_URL" in extra_env:
        yield
        return
    with portal_redis_user(env["BUNGEE_REDIS_PREFIX"]) as url:
        env["REDIS_URL"] = url
        yield


def platform_env(
    tmp: Path, database_url: str, port: int, network: Network | None = None, extra_env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a platform's processes: `database_url`, the machine's Redis under a
    prefix of the platform's own, its data under `tmp`; `extra_env` over all."""
    run_id = uuid.uuid4().hex[:10]
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": REDIS_URL,
        "BUNGEE_REDIS_PREFIX": f"bungee-it-{run_id}",
        "BUNGEE_CHANNEL_PREFIX": f"bungee-it-{run_id}",
        "BUNGEE_CELERY_QUEUE": f"bungee-it-{run_id}",
        "BUNGEE_DATA_DIR": str(tmp / "data"),
        "SECRET_KEY": secrets.token_urlsafe(50),
        "BUNGEE_SCHEDULE_TICK_S": "2",
        # Below Linux's ephemeral ports (32768 and up), where any client socket may hold one.
        "BUNGEE_MASTER_PORT_BASE": str(MASTER_PORT_LOW + port % (EPHEMERAL_PORTS_START - 5000 - MASTER_PORT_LOW)),
        "LOG_LEVEL": "INFO",
        # Each worker keeps at most a tenth of a core busy (agent --sim-pace: it sleeps nine times
        # the CPU time of each step after it): these jobs mostly wait (for joiners, deadlines,
        # the scheduler), and the workers of four platforms training on meanwhile were most of a
        # 2-core CI VM's CPU, slowing every other test.
        "BUNGEE_SIM_PACE": "10",
        **({"ALLOWED_HOSTS": f"127.0.0.1,{network.gateway}"} if network is not None else {}),
        **(extra_env or {}),
    }


@contextmanager
def running_platform(
    tmp: Path, agents: dict[str, int], extra_env: dict[str, str] | None = None, network: Network | None = None,
    portal_processes: int = 1, port: int | None = None,
) -> Iterator[Platform]:
    """The platform with an agent of `agents[name]` simulated devices per name; `extra_env` goes
    to every process (workers inherit their agent's). With a `network`, each agent runs on its
    host there, and the portal listens on the network's gateway (Redis must be reachable there
    too: `extra_env`'s REDIS_URL). `portal_processes` > 1 runs that many portal processes on the
    one address (portal.launcher.portal_command). `port`: the portal's (default: a free one),
    for a setting that must name it before the platform starts."""
    port = port or free_port()
    with ExitStack() as stack:
        database_url = stack.enter_context(platform_database())
        env = platform_env(tmp, database_url, port, network, extra_env)
        stack.enter_context(platform_redis(env, extra_env))
        group = ProcessGroup(log_dir=tmp / "logs", env=env)
        try:
            tokens = seed_users(group, list(agents))
            host = network.gateway if network is not None else "127.0.0.1"
            commands = platform_commands(port, env["BUNGEE_CELERY_QUEUE"], tmp, host, portal_processes)
            for name, command in commands.items():
                group.platform_process(name, command)
            platform = Platform(f"http://{host}:{port}", group, tokens, env, commands, network)
            platform.wait_for("the portal", platform.portal_answers, timeout_s=60)
            for name, devices in agents.items():
                platform.start_agent(name, devices)
            yield platform
        finally:
            group.stop()


@contextmanager
def running_portal(
    tmp: Path, extra_env: dict[str, str] | None = None, server: Callable[[int], list[str]] = portal_command
) -> Iterator[Platform]:
    """The portal alone on a database of its own, with no users, no Celery and no agents: for
    what the ASGI server itself does. `server` gives its command (after `python`) for a port:
    by default portal.launcher.portal_command, as a platform runs it."""
    port = free_port()
    with ExitStack() as stack:
        database_url = stack.enter_context(platform_database())
        env = platform_env(tmp, database_url, port, extra_env=extra_env)
        stack.enter_context(platform_redis(env, extra_env))
        group = ProcessGroup(log_dir=tmp / "logs", env=env)
        try:
            command = server(port)
            group.platform_process("portal", command)
            platform = Platform(f"http://127.0.0.1:{port}", group, {}, env, {"portal": command})
            platform.wait_for("the portal", platform.portal_answers, timeout_s=60)
            yield platform
        finally:
            group.stop()


@dataclass
class SocketRecorder:
    """A real WebSocket client in a thread, keeping every message it receives."""

    url: str
    token: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: str | None = None
    local_port: int | None = None
    """The client's end of the connection, once it is open (which portal process holds the
    other end: psutil's connections)."""

    def start(self) -> SocketRecorder:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        from websockets.sync.client import connect

        try:
            with connect(
                self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                origin="http://127.0.0.1",  # type: ignore[arg-type]
            ) as ws:
                self.local_port = ws.socket.getsockname()[1]
                while not self._stop.is_set():
                    try:
                        raw = ws.recv(timeout=0.2)
                    except TimeoutError:
                        continue
                    self.received_at.append(time.time())
                    self.messages.append(json.loads(raw))
        except Exception as exc:
            self.error = repr(exc)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in list(self.messages) if m.get("type") == kind]

    def job_states(self) -> list[dict[str, Any]]:
        """Every job summary the boards were sent, in order: `job` messages hold one, `jobs`
        messages (a scheduling cycle's, or a socket that was behind) several."""
        return [job for m in list(self.messages) if m.get("type") in ("job", "jobs")
                for job in ([m["job"]] if m["type"] == "job" else m["jobs"])]

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)


FAST_PROGRESS_ENV = {"BUNGEE_PROGRESS_EVERY_S": "0.2", "BUNGEE_PG_TIMEOUT_S": "20"}
"""Progress (and step times) five times a second, and a collective that waits 20 s for a peer."""


@contextmanager
def one_node_platform(tmp: Path, devices: int, extra_env: dict[str, str] | None = None) -> Iterator[Platform]:
    """`running_platform` with one agent, node-a, once its `devices` simulated devices are registered."""
    with running_platform(tmp, {"node-a": devices}, {**FAST_PROGRESS_ENV, **(extra_env or {})}) as platform:
        alice = platform.api("alice")
        platform.wait_for(
            f"{devices} devices",
            lambda: sum(len(n["devices"]) for n in alice.get("/api/cluster").json()["nodes"]) == devices,
        )
        yield platform
