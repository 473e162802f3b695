"""Starting and stopping the platform's processes together: the demo uses it, and so do the
integration tests. Each process gets its own log file; stopping sends SIGTERM to every process
group, waits, then SIGKILLs what is left."""

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


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


@dataclass
class ProcessGroup:
    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    processes: list[ManagedProcess] = field(default_factory=list)

    def start(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> ManagedProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")
        env = {**self.env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        managed = ManagedProcess(name, process, log_path, log_file)
        self.processes.append(managed)
        return managed

    def python(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> ManagedProcess:
        return self.start(name, [sys.executable, *args], extra_env)

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
        return [p for p in self.processes if p.process.poll() is not None]

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


def portal_command(port: int, host: str = "127.0.0.1", processes: int = 1) -> list[str]:
    """The portal's ASGI server, as arguments after `python`: daphne, or with `processes` > 1
    uvicorn's workers, that many processes answering on one address (the kernel hands each
    connection to one of them; they share the Redis channel layer, so an event sent from any
    process reaches the sockets of all)."""
    if processes > 1:
        return ["-m", "uvicorn", "portal.asgi:application", "--host", host, "--port", str(port),
                "--workers", str(processes), "--ws", "websockets", "--no-access-log"]
    return ["-m", "daphne", "-b", host, "-p", str(port), "portal.asgi:application"]


def platform_commands(
    port: int, queue: str, state_dir: Path, host: str = "127.0.0.1", portal_processes: int = 1
) -> dict[str, list[str]]:
    """The portal (portal_command), the Celery worker and beat, as argument lists after
    `python`."""
    return {
        "portal": portal_command(port, host, portal_processes),
        "worker": ["-m", "celery", "-A", "portal", "worker", "-Q", queue, "-c", "2", "--loglevel", "INFO",
                   "-n", f"scheduler-{port}@%h"],
        "beat": ["-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO", "-s",
                 str(state_dir / f"celerybeat-{port}")],
    }
