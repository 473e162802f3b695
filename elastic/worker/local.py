"""Run one generation of a job's workers on this machine, the way an agent would: one
`python -m elastic.worker` process per rank on CPU, rendezvous on a free localhost port, events
parsed from their stdout. For tests and benchmarks; the agent has its own supervision."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from elastic.wire import WORKER_EVENT_PREFIX, WorkerConfig, WorkerEvent
from elastic.worker import WORKER_CONFIG_ENV

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """Return a TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class WorkerOutput:
    """What one worker process wrote, collected as it runs."""

    rank: int
    events: list[WorkerEvent] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    """stdout lines that are not events."""
    stderr: str = ""
    returncode: int | None = None

    def of_kind(self, kind: str) -> list[WorkerEvent]:
        """Return the events of `kind`, in the order written."""
        return [event for event in self.events if event.kind == kind]

    def log_messages(self) -> list[str]:
        """Return the messages of the log events, in the order written."""
        return [event.message or "" for event in self.of_kind("log")]


class LocalWorkers:
    """The `world_size` worker processes of one generation of a job, on CPU, on this machine."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        world_size: int,
        run_dir: str | Path,
        job_id: int = 1,
        generation: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = dict(spec)
        self.world_size = world_size
        self.run_dir = Path(run_dir)
        self.job_id = job_id
        self.generation = generation
        self.env = dict(os.environ if env is None else env)
        self.outputs = [WorkerOutput(rank) for rank in range(world_size)]
        self._processes: list[subprocess.Popen[str]] = []
        self._readers: list[threading.Thread] = []
        self._changed = threading.Condition()

    def config(self, rank: int, port: int) -> WorkerConfig:
        """Return the WorkerConfig of `rank` for a rendezvous on `port`."""
        return WorkerConfig(
            job_id=self.job_id,
            generation=self.generation,
            rank=rank,
            world_size=self.world_size,
            master_addr=LOCALHOST,
            master_port=port,
            device="cpu",
            spec=self.spec,
            run_dir=str(self.run_dir),
        )

    def start(self) -> LocalWorkers:
        """Start every rank's process; return self. Raises OSError if one cannot start."""
        port = free_port()
        for rank in range(self.world_size):
            env = {**self.env, WORKER_CONFIG_ENV: self.config(rank, port).model_dump_json()}
            process = subprocess.Popen(
                [sys.executable, "-m", "elastic.worker"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self._processes.append(process)
            assert process.stdout is not None and process.stderr is not None
            self._read_in_background(process.stdout, self._stdout_reader(self.outputs[rank]))
            self._read_in_background(process.stderr, self._stderr_reader(self.outputs[rank]))
        return self

    def wait_for(
        self, rank: int, predicate: Callable[[WorkerEvent], bool], timeout_s: float = 60.0
    ) -> WorkerEvent:
        """Return the first event of `rank` that satisfies `predicate`, waiting for it.

        Raises TimeoutError if none comes within `timeout_s`, or if the process ends first.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for event in self.outputs[rank].events:
                    if predicate(event):
                        return event
                if self._processes[rank].poll() is not None and not self._readers_alive():
                    raise TimeoutError(f"rank {rank} exited before the event came")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no such event from rank {rank} in {timeout_s} s")
                self._changed.wait(min(remaining, 0.1))

    def send_signal(self, rank: int, signal_number: int = signal.SIGTERM) -> None:
        """Send `signal_number` to `rank`'s process."""
        self._processes[rank].send_signal(signal_number)

    def wait(self, timeout_s: float = 120.0) -> list[WorkerOutput]:
        """Wait for every process to exit and its output to be read; return the outputs.

        Raises subprocess.TimeoutExpired, after killing every process, if they do not all exit
        within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for process, output in zip(self._processes, self.outputs, strict=True):
                output.returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for reader in self._readers:
            reader.join()
        return self.outputs

    def kill(self) -> None:
        """Kill every process still running."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            process.wait()

    def __enter__(self) -> LocalWorkers:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def _readers_alive(self) -> bool:
        return any(reader.is_alive() for reader in self._readers)

    def _read_in_background(self, pipe: IO[str], handle: Callable[[str], None]) -> None:
        def read() -> None:
            for line in pipe:
                with self._changed:
                    handle(line.rstrip("\n"))
                    self._changed.notify_all()
            with self._changed:
                self._changed.notify_all()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self._readers.append(reader)

    @staticmethod
    def _stdout_reader(output: WorkerOutput) -> Callable[[str], None]:
        def handle(line: str) -> None:
            if line.startswith(WORKER_EVENT_PREFIX):
                output.events.append(WorkerEvent.model_validate_json(line.removeprefix(WORKER_EVENT_PREFIX)))
            else:
                output.lines.append(line)

        return handle

    @staticmethod
    def _stderr_reader(output: WorkerOutput) -> Callable[[str], None]:
        def handle(line: str) -> None:
            output.stderr += line + "\n"

        return handle
