"""The node's commands: a reader that follows the node's Redis stream and a dispatcher that
hands each command to the part of the agent that carries it out.

The portal XADDs each command as one entry whose field "command" holds the command's JSON
(elastic.wire.parse_command); the stream is named by elastic.wire.command_stream. An entry that
does not parse is logged and skipped. The reader starts after the stream's position at the
moment the agent began registering, so that a command the portal sends while handling the
registration is not missed and one from before is not replayed (see `StreamMark`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import ValidationError

from agent.code import CodeCache, CodeUnavailable
from agent.devices import DeviceBackend, DeviceError
from agent.drain import Drain
from agent.environments import BuildFailed, Environments
from agent.export import CheckpointExporter
from agent.supervisor import WorkerSupervisor
from elastic.requirements import Declared, RequirementsError, declared_in_directory
from elastic.wire import (
    DrainCommand,
    ExportCommand,
    LaunchCommand,
    SimulateOwnerCommand,
    SimulateSlowdownCommand,
    StopCommand,
    parse_command,
)

log = logging.getLogger(__name__)

MAX_BUILD_LOG_LINES = 200
"""The last lines of a failed build's output that go to the job's log."""

COMMAND_FIELD = "command"
"""The field of a stream entry that holds the command's JSON."""
CLOCK_MARGIN_S = 0.1
"""Read this much further back than the registration began, when the position had to be
worked out from Redis's clock: a command is idempotent, a missed one is lost."""

AgentCommand = (
    LaunchCommand | StopCommand | ExportCommand | SimulateOwnerCommand | SimulateSlowdownCommand | DrainCommand
)
StreamReplies = list[tuple[str, list[tuple[str, dict[str, str]]]]] | None
"""What XREAD answers on a client that decodes responses."""


def redis_client(url: str, block_s: float = 1.0) -> redis.Redis:
    """Returns a client for `url` whose reads outlast a blocking read of `block_s`."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=block_s + 5, socket_connect_timeout=5
    )


def redis_location(url: str | None) -> str | None:
    """`url` without its credentials: which Redis and database it names."""
    if url is None:
        return None
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def last_entry_id(client: redis.Redis, stream: str) -> str:
    """Returns the id of the stream's newest entry, or "0-0" if the stream is empty or does
    not exist. Raises redis.RedisError."""
    newest = client.xrevrange(stream, count=1)
    return str(newest[0][0]) if newest else "0-0"


def entry_id_at(client: redis.Redis, local_time: float, margin_s: float = CLOCK_MARGIN_S) -> str:
    """Returns a stream id just before Redis's clock read `local_time` (this machine's clock,
    Unix seconds) less `margin_s`; entries XADDed since have greater ids. The two clocks'
    offset is measured with Redis TIME. Raises redis.RedisError."""
    before = time.time()
    seconds, micros = client.time()
    after = time.time()
    offset = seconds + micros / 1e6 - (before + after) / 2
    uncertainty = (after - before) / 2
    millis = int((local_time + offset - uncertainty - margin_s) * 1000)
    return f"{max(millis, 0)}-0"


@dataclass(frozen=True)
class StreamMark:
    """Where the command stream stood when the agent began registering.

    The portal names the stream and its Redis in the registration reply, so the position can be
    read before registering only where both were known beforehand (an overriding Redis URL, or
    an earlier registration); `last_id` is then the newest entry's id. Otherwise it is worked
    out after the reply from `taken_at` and Redis's clock.
    """

    taken_at: float
    redis_url: str | None = None
    stream: str | None = None
    last_id: str | None = None

    @classmethod
    def take(cls, redis_url: str | None, stream: str | None) -> StreamMark:
        """Returns the mark for now; reads the newest id where url and stream are known and
        Redis answers."""
        taken_at = time.time()
        if redis_url is None or stream is None:
            return cls(taken_at)
        try:
            with redis_client(redis_url) as client:
                last_id = last_entry_id(client, stream)
        except redis.RedisError as err:
            log.warning("could not read the position of %s at %s: %s", stream, redis_location(redis_url), err)
            return cls(taken_at)
        return cls(taken_at, redis_url, stream, last_id)

    def start_id(self, client: redis.Redis, redis_url: str, stream: str) -> str:
        """Returns the id to read `stream` at `redis_url` after. Raises redis.RedisError."""
        # The agent's user gets a new password at each registration: the same Redis and stream
        # under other credentials is the same position.
        if self.last_id is not None and (redis_location(self.redis_url), self.stream) == (redis_location(redis_url), stream):
            return self.last_id
        return entry_id_at(client, self.taken_at)


class CommandDispatcher:
    """Hands each kind of command to its handler: launch and stop to the supervisor, an export to
    the checkpoint exporter, a played owner to the device backend, a drain to the agent's drain
    (while it drains, a launch starts no new worker here). A handler's failure is logged, never raised. A launch's
    workers reach their membership board with the Redis URL the launch carries (the job's own Redis user), never the
    agent's, whose user reads this node's commands."""

    def __init__(
        self,
        supervisor: WorkerSupervisor,
        backend: DeviceBackend,
        report_now: Callable[[], None] | None = None,
        code: CodeCache | None = None,
        exporter: CheckpointExporter | None = None,
        drain: Drain | None = None,
        environments: Environments | None = None,
    ) -> None:
        self._environments = environments
        self._pythons: dict[int, str] = {}
        """Job id -> the interpreter of its environment, once one of its launches had it built: a
        later launch that starts no worker here keeps it (so no standby is prepared for the job
        in the node's environment)."""
        self._drain = drain
        self._exporter = exporter
        self._backend = backend
        self._report_now = report_now
        self._supervisor = supervisor
        self._code = code
        self._handlers: Mapping[type[Any], Callable[[Any], object]] = {
            LaunchCommand: self._launch,
            StopCommand: supervisor.stop,
            ExportCommand: self._export,
            SimulateOwnerCommand: self._play_owner,
            SimulateSlowdownCommand: lambda command: backend.set_slowdown(command.device_index, command.factor),
            DrainCommand: self._start_drain,
        }

    def _launch(self, command: LaunchCommand) -> None:
        """Starts the command's workers; a job with code of its own gets it first (fetched and
        checked once per digest), and one that starts from another job's model gets that; if
        either fails, its workers here are reported as failed to
        start. Code that declares requirements gets its environment first, in a thread of its own
        (`_launch_in_environment`), so that a build holds up no other command."""
        if self._drain is not None and self._drain.notice is not None and command.workers:
            # The portal plans this node's jobs without it once it reads the drain notice; a
            # generation published before that starts no worker here (its survivors and leavers
            # still follow it).
            log.info("job %d generation %d: draining, so none of its %d new workers starts here",
                     command.job_id, command.generation, len(command.workers))
            command = command.model_copy(update={"workers": []})
        digest = command.spec.get("code")
        code_dir = initial_model = None
        # Survivors too (members): the launch is the newest this node has of the job, and a standby
        # prepared for its next joiner builds from it (its code is here already: no fetch).
        if (command.workers or command.members) and (digest or command.spec.get("init_from")):
            try:
                if self._code is None:
                    raise CodeUnavailable("this agent cannot fetch code or models (no portal client)")
                if digest:
                    code_dir = self._code.prepare(command.job_id, str(digest))
                if command.spec.get("init_from"):
                    initial_model = self._code.initial_model(command.job_id)
            except CodeUnavailable as err:
                self._supervisor.launch_failed(command, str(err))
                return
        declared = None
        if code_dir is not None:
            try:
                declared = declared_in_directory(
                    code_dir, self._environments is not None and self._environments.settings.index_options
                )
            except RequirementsError as err:
                self._supervisor.launch_failed(command, f"the job's requirements are refused: {err}", "user_error")
                return
        if declared is None:
            python = None if command.workers else self._pythons.get(command.job_id)
            self._supervisor.launch(command, self._backend, command.redis_url, code_dir, initial_model, python)
            return
        threading.Thread(
            target=self._launch_in_environment, args=(command, declared, code_dir, initial_model),
            name=f"environment-job-{command.job_id}", daemon=True,
        ).start()

    def _launch_in_environment(
        self, command: LaunchCommand, declared: Declared, code_dir: Path | None, initial_model: Path | None
    ) -> None:
        """Builds (or finds) the job's environment, saying so in the job's log, then starts the
        command's workers in it. A build that fails fails the job at once ("user_error": the same
        requirements fail on every node), uv's output in its log and the gist in its message."""
        supervisor = self._supervisor
        if self._environments is None:
            supervisor.launch_failed(command, "this agent cannot build environments (no --env-dir)")
            return
        supervisor.job_log(command, f"building the environment ({len(declared.requirements)} requirements from "
                                    f"{declared.source}), or finding it in this node's cache")
        try:
            environment = self._environments.ensure(
                declared, lambda seconds: supervisor.job_log(command, f"building the environment ({seconds:.0f} s)")
            )
        except BuildFailed as err:
            for line in err.output.splitlines()[-MAX_BUILD_LOG_LINES:]:
                supervisor.job_log(command, line)
            supervisor.launch_failed(command, f"the job's environment could not be built: {err}", "user_error")
            return
        supervisor.job_log(command, (
            f"built the environment {environment.digest[:12]} in {environment.built_s:.1f} s"
            if environment.built_s is not None else
            f"the environment {environment.digest[:12]} is in this node's cache"
        ))
        own_packages = environment.own_packages()
        if own_packages is not None:
            supervisor.job_environment(command, own_packages)
        self._pythons[command.job_id] = str(environment.python)
        with self._environments.hold(environment.digest):
            supervisor.launch(command, self._backend, command.redis_url, code_dir, initial_model, str(environment.python))

    def _start_drain(self, command: DrainCommand) -> None:
        if self._drain is None:
            log.warning("cannot drain: this agent has no drain")
            return
        self._drain.ask(command.cause, command.deadline_s)
        if self._report_now is not None:  # at once: the portal plans without the node
            self._report_now()

    def _export(self, command: ExportCommand) -> None:
        if self._exporter is None:
            log.warning("job %d: cannot export its checkpoint: this agent has no exporter", command.job_id)
            return
        self._exporter.start(command)

    def _play_owner(self, command: SimulateOwnerCommand) -> None:
        """Plays the owner, then has the agent report at once: the portal takes a device back
        on the report, and the borrowing worker has seconds to leave."""
        self._backend.set_owner_present(command.device_index, command.present)
        if self._report_now is not None:
            self._report_now()

    def dispatch(self, command: AgentCommand) -> None:
        handler = self._handlers[type(command)]
        try:
            handler(command)
        except DeviceError as err:
            log.warning("could not carry out %s: %s", command.kind, err)
        except Exception:
            log.exception("could not carry out %s", command.model_dump_json())


class CommandReader:
    """Follows `stream` at `redis_url` in a thread of its own, passing each command to `handle`
    in stream order. It starts after `start`: an entry id, or a StreamMark whose id is worked
    out once Redis first answers, so that Redis being away at registration loses nothing.
    Redis going away is logged and retried."""

    def __init__(
        self,
        redis_url: str,
        stream: str,
        start: str | StreamMark,
        handle: Callable[[AgentCommand], None],
        block_s: float = 1.0,
    ) -> None:
        self.redis_url = redis_url
        self.stream = stream
        self._start = start
        self._last_id: str | None = start if isinstance(start, str) else None
        self._handle = handle
        self._block_ms = max(1, int(block_s * 1000))
        self._client = redis_client(redis_url, block_s)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="command-reader", daemon=True)

    @property
    def last_id(self) -> str | None:
        """The id of the last entry read (or of the start); None until Redis first answered."""
        return self._last_id

    def start(self) -> None:
        if self._last_id is not None:
            self._log_start()
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops reading; waits up to `timeout_s` for the thread (a blocking read ends within
        `block_s`). With 0, returns at once: an agent on its way out has nothing to wait for, and
        the thread, a daemon, closes its client when its read ends."""
        self._stopping.set()
        if self._thread.is_alive() and timeout_s > 0:
            self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._client.close()

    def _run(self) -> None:
        try:
            self._read()
        finally:
            self._client.close()

    def _read(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                if self._last_id is None:
                    self._last_id = self._start_id()
                replies = cast(
                    StreamReplies,
                    self._client.xread({self.stream: self._last_id}, count=100, block=self._block_ms),
                )
            except redis.RedisError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning(
                        "cannot read commands from %s (%d failures in a row): %s",
                        redis_location(self.redis_url),
                        failures,
                        err,
                    )
                self._stopping.wait(min(5.0, 0.5 * failures))
                continue
            if failures:
                log.info("reading commands from %s again", redis_location(self.redis_url))
                failures = 0
            for _stream, entries in replies or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._receive(entry_id, fields)

    def _start_id(self) -> str:
        assert isinstance(self._start, StreamMark)
        start_id = self._start.start_id(self._client, self.redis_url, self.stream)
        self._last_id = start_id
        self._log_start()
        return start_id

    def _log_start(self) -> None:
        log.info("reading commands from %s at %s after %s", self.stream, redis_location(self.redis_url), self._last_id)

    def _receive(self, entry_id: str, fields: Mapping[str, str]) -> None:
        raw = fields.get(COMMAND_FIELD)
        if raw is None:
            log.warning(
                "skipping entry %s of %s: no %r field (fields: %s)",
                entry_id,
                self.stream,
                COMMAND_FIELD,
                sorted(fields),
            )
            return
        try:
            command = parse_command(raw)
        except ValidationError as err:
            log.warning("skipping entry %s of %s: not a command: %s", entry_id, self.stream, err)
            return
        log.info("command %s: %s", entry_id, command.kind)
        self._handle(command)
