"""Starting and stopping the platform's processes together: the demo uses it, and so do the
integration tests. Each process gets its own log file; stopping sends SIGTERM to every process
group, waits, then SIGKILLs what is left. The Celery processes are started again when they exit
on their own (RESTARTED), as docker-compose.yml's `restart: unless-stopped` does in a
deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent

RESTARTED = frozenset({"worker", "beat"})
"""The processes a deployment's supervisor starts again when they exit. Celery's worker can exit
on its own when Redis goes away under it: kombu (5.7) fails to restore a task it had not yet
acknowledged ("Unrecoverable error: AttributeError: 'NoneType' object has no attribute
'hostname'", seen when the fault test killed Redis during a scheduler tick), and nothing in the
worker brings it back."""
RESTART_BURST = 5
RESTART_WINDOW_S = 60.0
"""A process that exits more than RESTART_BURST times within RESTART_WINDOW_S stays down and is
reported dead, as systemd's StartLimitBurst does: a crash loop is a failure, not an outage."""


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = False
    restarted_at: list[float] = field(default_factory=list)
    """When it was started again (time.monotonic()), the last RESTART_WINDOW_S."""
    ends_by_itself: bool = False
    """Asked to end on its own (an agent told to drain): its exit is no death."""


@dataclass
class ProcessGroup:
    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    processes: list[ManagedProcess] = field(default_factory=list)

    def start(
        self, name: str, args: list[str], extra_env: dict[str, str] | None = None, restart: bool = False
    ) -> ManagedProcess:
        """Starts `args` as the process `name`; with `restart`, `dead` starts it again when it
        has exited (up to RESTART_BURST times in RESTART_WINDOW_S)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")
        env = {**self.env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        managed = ManagedProcess(name, _launch(args, env, log_file), log_path, log_file, args, env, restart)
        self.processes.append(managed)
        return managed

    def python(
        self, name: str, *args: str, extra_env: dict[str, str] | None = None, restart: bool = False
    ) -> ManagedProcess:
        return self.start(name, [sys.executable, *args], extra_env, restart)

    def platform_process(self, name: str, command: list[str]) -> ManagedProcess:
        """Starts the platform's process `name` with its `command` (platform_commands), to be
        started again when it exits if it is one of RESTARTED."""
        return self.python(name, *command, restart=name in RESTARTED)

    def run(self, *args: str, timeout: float = 300) -> str:
        """Run a Python command to completion in the group's environment; returns its output.
        Raises subprocess.CalledProcessError if it fails."""
        done = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
        return done.stdout

    def dead(self) -> list[ManagedProcess]:
        """The processes that have exited and stay down (not those asked to end by themselves).
        One started with `restart` is started again here instead (its log says so), unless it
        already was RESTART_BURST times in the last RESTART_WINDOW_S."""
        now = time.monotonic()
        down = []
        for p in self.processes:
            code = p.process.poll()
            if code is None or p.ends_by_itself:
                continue
            p.restarted_at = [at for at in p.restarted_at if now - at < RESTART_WINDOW_S]
            if not p.restart or len(p.restarted_at) >= RESTART_BURST:
                down.append(p)
                continue
            p.restarted_at.append(now)
            p.log_file.write(f"bungee launcher: {p.name} exited with code {code}; starting it again "
                             f"({len(p.restarted_at)} of {RESTART_BURST} in {RESTART_WINDOW_S:.0f} s)\n".encode())
            p.log_file.flush()
            p.process = _launch(p.args, p.env, p.log_file)
        return down

    def tail(self, name: str, lines: int = 40) -> str:
        for p in self.processes:
            if p.name == name:
                return "\n".join(p.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 20.0) -> None:
        for p in reversed(self.processes):
            if p.process.poll() is None:
                try:
                    os.killpg(p.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                p.process.wait(remaining)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.process.wait()
            p.log_file.close()
        self.processes.clear()


def _launch(args: list[str], env: dict[str, str], log_file: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def portal_command(port: int, host: str = "127.0.0.1", processes: int = 1) -> list[str]:
    """The portal's ASGI server (portal.serve: uvicorn, as everywhere the portal runs), as
    arguments after `python`; with `processes` > 1, that many processes answering on one address
    (the kernel hands each connection to one of them; they share the Redis channel layer, so an
    event sent from any process reaches the sockets of all)."""
    return ["-m", "portal.serve", "--host", host, "--port", str(port), "--processes", str(processes)]


def platform_commands(
    port: int, queue: str, state_dir: Path, host: str = "127.0.0.1", portal_processes: int = 1
) -> dict[str, list[str]]:
    """The portal (portal_command), the Celery worker and beat, as argument lists after
    `python`. The worker starts without mingle and gossip: mingle asks the other workers for
    their revoked tasks and logical clocks, waiting a second for answers at every start, and
    gossip follows their events; our tasks are never revoked and need neither."""
    return {
        "portal": portal_command(port, host, portal_processes),
        "worker": ["-m", "celery", "-A", "portal", "worker", "-Q", queue, "-c", "2", "--loglevel", "INFO",
                   "--without-mingle", "--without-gossip", "-n", f"scheduler-{port}@%h"],
        "beat": ["-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO", "-s",
                 str(state_dir / f"celerybeat-{port}")],
    }
