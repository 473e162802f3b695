"""Run a job's workers on this machine, coordinated the way the portal and the agents do it: one
`python -m elastic.worker` process per slot on CPU (or one GPU per slot), membership records on the job's board in
Redis (elastic.membership.redis), a free localhost port per generation, events decoded from the
workers' stdout as the agent decodes them (elastic.worker.event_codec). For tests and benchmarks;
the platform has its own scheduler and supervision.

`LocalJob.start` publishes the first generation; `resize` publishes the next one, starting
processes only for slots that have none (joiners); survivors and leavers read the record. Each
record is composed by the portal's rule (elastic.membership.compose): holders of the state first. With
`heal` on, a worker that dies makes the job publish a generation without it, as the portal does
when an agent reports the death; if no worker holding the state is left, the whole target is
started again, from the periodic checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from elastic.membership.compose import Seat, compose_membership, holders_first
from elastic.membership.redis import RedisBoard
from elastic.wire import Membership, WorkerConfig, WorkerEvent, member_key
from elastic.worker import (
    COMPLETED_EXIT_CODE,
    FAILED_EXIT_CODE,
    LEFT_EXIT_CODE,
    STOPPED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    WORKER_CONFIG_ENV,
)
from elastic.worker.event_codec import decode, is_event_line
from elastic.worker.forkserver import ForkedProcess, ForkServerError, shared_server
from elastic.worker.settings import WorkerSettings

LOCALHOST = "127.0.0.1"
NODE = "local"
_CLEAN_EXITS = (COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE, LEFT_EXIT_CODE)
"""Exits after which `heal` publishes no new generation; nor after USER_ERROR_EXIT_CODE, the job's
own code failing, which the portal does not restart either."""


def _seat(slot: int) -> Seat:
    return Seat(NODE, slot, LOCALHOST)


def free_port(host: str = LOCALHOST) -> int:
    """Return a TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class WorkerOutput:
    """What one worker process wrote, collected as it runs."""

    slot: int
    pid: int
    launched_generation: int
    launched_rank: int
    events: list[WorkerEvent] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    """stdout lines that do not claim to be events (a malformed event line is a log event)."""
    stderr: str = ""
    returncode: int | None = None
    holds_state: bool = False
    """It joined a generation (it sent a "joined" event)."""
    exiting_at: float | None = None
    """time.monotonic() when its "exiting" line, its last, arrived."""
    ended_at: float | None = None
    """time.monotonic() when its process had ended."""

    @property
    def exit_s(self) -> float | None:
        """From its "exiting" line to the end of its process: what its exit took after the
        worker had said all it had to say (None where either is missing)."""
        if self.exiting_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.exiting_at

    def of_kind(self, kind: str) -> list[WorkerEvent]:
        """Return the events of `kind`, in the order written."""
        return [event for event in self.events if event.kind == kind]

    def log_messages(self) -> list[str]:
        """Return the messages of the log events, in the order written."""
        return [event.message or "" for event in self.of_kind("log")]


DEFAULT_COMMAND = [sys.executable, "-m", "elastic.worker"]
"""How a worker is started unless told otherwise: such a worker on CPU is forked from a fork
server (elastic.worker.forkserver) rather than started as a new interpreter."""


class LocalJob:
    """One job's workers on CPU on this machine; slots play the devices of one node. Raises
    WorkerSettingsError, before any worker starts, if `env` holds a value a worker cannot use."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        run_dir: str | Path,
        redis_url: str,
        job_id: int = 1,
        env: Mapping[str, str] | None = None,
        heal: bool = True,
        board_key: str | None = None,
        device: str = "cpu",
        task: tuple[Path, str] | None = None,
        command: Sequence[str] = tuple(DEFAULT_COMMAND),
        fork: bool = True,
    ) -> None:
        self.spec = dict(spec)
        self.command = list(command)
        """How a worker is started (a benchmark may run the worker's main another way)."""
        self.fork = fork
        """Fork the workers (the default command on CPU) from a fork server rather than start
        each as a new interpreter (seconds of imports)."""
        self.run_dir = Path(run_dir)
        self.redis_url = redis_url
        self.job_id = job_id
        self.env = dict(os.environ if env is None else env)
        self.heal = heal
        self.device = device
        self.task = task
        """The job's own code, (directory, module:ClassName); None: the spec's workload."""
        """"cpu", or "cuda": slot i is then GPU i, or GPU 0 for every slot where the env sets
        BUNGEE_SHARED_GPU=1 (see WorkerSettings.shared_gpu)."""
        self._shared_gpu = WorkerSettings.from_env(self.env).shared_gpu
        self.key = board_key or f"bungee-local-{uuid.uuid4().hex[:10]}:job:{job_id}"
        self.board = RedisBoard.connect(redis_url, self.key)
        self.outputs: list[WorkerOutput] = []
        """Every process started, in start order."""
        self.records: list[Membership] = []
        self.target: list[int] = []
        self._processes: dict[int, subprocess.Popen[str] | ForkedProcess] = {}
        self._readers: list[threading.Thread] = []
        self._changed = threading.Condition()
        self._lock = threading.RLock()
        self._closing = False

    # --- membership --------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.records[-1].generation if self.records else 0

    def start(self, slots: Sequence[int], virtual_workers: Mapping[int, int] | None = None) -> LocalJob:
        """Publish generation 1 on `slots` and start a worker on each; return self."""
        self.resize(slots, virtual_workers=virtual_workers)
        return self

    def resize(
        self,
        slots: Sequence[int],
        leavers_timeout_s: float = 60.0,
        virtual_workers: Mapping[int, int] | None = None,
    ) -> Membership:
        """Publish the next generation on `slots` (in this order, survivors moved first) and
        start a worker on each slot that has none running; return the record. Like the portal,
        it first lets the leavers of the last switch finish leaving (up to `leavers_timeout_s`),
        so that none is taken for a survivor. `virtual_workers`: a strict job's virtual workers
        per slot (default: even shares)."""
        latest = set(self.records[-1].keys()) if self.records else set()
        self.wait_until(
            lambda: not [o for o in self.live() if member_key(NODE, o.slot) not in latest], leavers_timeout_s
        )
        with self._lock:
            self.target = list(slots)
            return self._publish(list(slots), virtual_workers)

    def _publish(self, slots: list[int], virtual_workers: Mapping[int, int] | None = None) -> Membership:
        live = {output.slot: output for output in self.outputs if output.returncode is None}
        previous = {key: rank for rank, key in enumerate(self.records[-1].keys())} if self.records else {}
        holder_ranks = {
            slot: previous.get(member_key(NODE, slot), len(previous))
            for slot, output in live.items()
            if output.holds_state
        }
        ordered = holders_first(slots, holder_ranks)
        record = compose_membership(
            self.job_id,
            self.generation + 1,
            [_seat(slot) for slot in ordered],
            [_seat(slot) for slot in sorted(holder_ranks, key=holder_ranks.__getitem__)],
            master_port=free_port(),
            virtual_workers={member_key(NODE, slot): n for slot, n in virtual_workers.items()}
            if virtual_workers
            else None,
        )
        self.board.publish(record)
        self.records.append(record)
        for rank, slot in enumerate(ordered):
            if slot not in live:
                self._spawn(record, rank, slot)
        return record

    def _config(self, record: Membership, rank: int, slot: int) -> WorkerConfig:
        return WorkerConfig(
            job_id=self.job_id,
            generation=record.generation,
            rank=rank,
            world_size=record.world_size,
            master_addr=record.master_addr,
            master_port=record.master_port,
            device="cpu" if self.device == "cpu" else f"cuda:{0 if self._shared_gpu else slot}",
            spec=self.spec,
            run_dir=str(self.run_dir),
            node=NODE,
            device_index=slot,
            redis_url=self.redis_url,
            coordination_key=self.key,
            code_dir=str(self.task[0]) if self.task else None,
            entrypoint=self.task[1] if self.task else None,
        )

    def _spawn(self, record: Membership, rank: int, slot: int) -> None:
        env = {**self.env, WORKER_CONFIG_ENV: self._config(record, rank, slot).model_dump_json()}
        forkable = self.fork and self.command == DEFAULT_COMMAND and self.device == "cpu"
        forked = self._fork(env) if forkable else None
        process: subprocess.Popen[str] | ForkedProcess
        if forked is not None:
            process = forked
        else:
            process = subprocess.Popen(
                self.command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        output = WorkerOutput(
            slot=slot, pid=process.pid, launched_generation=record.generation, launched_rank=rank
        )
        self.outputs.append(output)
        self._processes[process.pid] = process
        assert process.stdout is not None and process.stderr is not None
        stdout = self._read_in_background(process.stdout, self._stdout_reader(output, self.job_id))
        self._read_in_background(process.stderr, self._stderr_reader(output))
        threading.Thread(target=self._watch, args=(process, output, stdout), daemon=True).start()

    @staticmethod
    def _fork(env: dict[str, str]) -> ForkedProcess | None:
        """The worker forked from this process's fork server for `env` (elastic.worker.forkserver:
        torch and the runtime imported once for all the workers started here), its stdout and
        stderr pipes of ours; None if the server cannot fork it (the worker then starts as a new
        interpreter)."""
        server = shared_server(env)
        if not server.wait_ready():
            return None
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            process = server.spawn("elastic.worker", env, null, out_write, err_write)
        except ForkServerError:
            for fd in (out_read, err_read):
                os.close(fd)
            return None
        finally:
            for fd in (null, out_write, err_write):
                os.close(fd)
        process.stdout = open(out_read, encoding="utf-8", errors="replace")  # noqa: SIM115 - read to its end by a reader thread
        process.stderr = open(err_read, encoding="utf-8", errors="replace")  # noqa: SIM115
        return process

    def _watch(self, process: subprocess.Popen[str] | ForkedProcess, output: WorkerOutput, stdout: threading.Thread) -> None:
        code = process.wait()
        if code is None:  # a forked worker whose fork server went first (it was killed)
            code = FAILED_EXIT_CODE
        output.ended_at = time.monotonic()
        stdout.join(timeout=10)
        # One step, so that nobody waiting sees every worker gone between a death and its heal.
        with self._lock, self._changed:
            output.returncode = code
            if not self._closing and self.records:
                named = member_key(NODE, output.slot) in self.records[-1].keys()
                if self.heal and code not in (*_CLEAN_EXITS, USER_ERROR_EXIT_CODE):
                    self._replace(output)
                elif code == LEFT_EXIT_CODE and named:
                    # It left at a switch just before a newer generation took its slot back.
                    self._publish(self.target)
            self._changed.notify_all()

    def _replace(self, dead: WorkerOutput) -> None:
        """What the portal does when an agent reports a death: a generation without it."""
        live = {output.slot for output in self.outputs if output.returncode is None}
        holders = [output for output in self.outputs if output.returncode is None and output.holds_state]
        if not holders:
            self._publish(self.target)
            return
        latest = self.records[-1].keys()
        remaining = [slot for slot in self.target if member_key(NODE, slot) in latest and slot in live]
        self._publish(remaining or [holder.slot for holder in holders])

    # --- processes ---------------------------------------------------------------------------

    def live(self) -> list[WorkerOutput]:
        """The workers still running."""
        return [output for output in self.outputs if output.returncode is None]

    def worker_on(self, slot: int) -> WorkerOutput:
        """The newest worker started on `slot`. Raises KeyError if none was."""
        for output in reversed(self.outputs):
            if output.slot == slot:
                return output
        raise KeyError(f"no worker was started on slot {slot}")

    def send_signal(self, slot: int, signal_number: int = signal.SIGTERM) -> None:
        """Send `signal_number` to the running worker on `slot`."""
        output = self.worker_on(slot)
        self._processes[output.pid].send_signal(signal_number)

    def trained_past(self, generation: int, steps: int, form_s: float = 180.0, train_s: float = 120.0) -> int:
        """Waits until generation `generation` formed (within `form_s`) and then trained `steps`
        steps past the step it formed at (within `train_s`); returns the step reached. Raises
        TimeoutError."""
        _, formed = self.wait_for(lambda _, e: e.kind == "resized" and e.generation == generation, form_s)
        target = (formed.step or 0) + steps
        _, event = self.wait_for(
            lambda _, e: e.kind == "progress" and e.generation == generation and (e.step or 0) >= target,
            train_s,
        )
        return event.step or 0

    def wait_for(
        self, predicate: Callable[[WorkerOutput, WorkerEvent], bool], timeout_s: float = 60.0
    ) -> tuple[WorkerOutput, WorkerEvent]:
        """Return the first (worker, event) that satisfies `predicate`, waiting for it. Raises
        TimeoutError if none comes within `timeout_s`, or every worker has exited first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for output in self.outputs:
                    for event in output.events:
                        if predicate(output, event):
                            return output, event
                if self.outputs and all(o.returncode is not None for o in self.outputs):
                    raise TimeoutError(f"every worker exited before the event came: {self.describe()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no such event in {timeout_s} s: {self.describe()}")
                self._changed.wait(min(remaining, 0.1))

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Wait until `condition()` holds (checked whenever a worker writes). Raises
        TimeoutError."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not condition():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"condition not met in {timeout_s} s: {self.describe()}")
                self._changed.wait(min(remaining, 0.1))

    def wait(self, timeout_s: float = 120.0) -> list[WorkerOutput]:
        """Wait for every process to exit and its output to be read; return every worker's
        output. Raises TimeoutError, after killing every process, if they do not all exit in
        time."""
        try:
            self.wait_until(lambda: all(output.returncode is not None for output in self.outputs), timeout_s)
        except TimeoutError:
            self.kill()
            raise
        for reader in self._readers:
            reader.join()
        return self.outputs

    def kill(self) -> None:
        """Kill every process still running, without healing."""
        with self._lock:
            self._closing = True
        for process in self._processes.values():
            if process.poll() is None:
                process.kill()
        for process in self._processes.values():
            process.wait()

    def describe(self) -> str:
        """Every worker's slot, pid, exit code, last log lines and stderr tail, for failures."""
        return "\n".join(
            f"slot {o.slot} pid {o.pid} exit {o.returncode}: {o.log_messages()[-5:]} {o.lines[-5:]} "
            f"{o.stderr[-2000:]}"
            for o in self.outputs
        )

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
        for key in self.board.client.scan_iter(f"{self.key}:*"):
            self.board.client.delete(key)
        self.board.close()

    def _read_in_background(self, pipe: IO[str], handle: Callable[[str], None]) -> threading.Thread:
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
        return reader

    @staticmethod
    def _stdout_reader(output: WorkerOutput, job_id: int) -> Callable[[str], None]:
        key = {"job_id": job_id, "generation": output.launched_generation, "rank": output.launched_rank}

        def handle(line: str) -> None:
            if not is_event_line(line):
                output.lines.append(line)
                return
            event = decode(key, line)
            output.events.append(event)
            if event.kind == "exiting":
                output.exiting_at = time.monotonic()
            elif event.kind == "joined":
                output.holds_state = True

        return handle

    @staticmethod
    def _stderr_reader(output: WorkerOutput) -> Callable[[str], None]:
        def handle(line: str) -> None:
            output.stderr += line + "\n"

        return handle
