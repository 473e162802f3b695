"""The agent's entry point: parse the command line (agent.settings), build the parts, run until
told to stop.

`Agent.run` re-adopts the workers an earlier agent of this node left running (their records are
in the state directory, see agent.supervisor), registers the node with them (retrying until the
portal answers), follows the node's command stream, and every report interval sends the portal
fresh device samples, the workers' events and the running workers; a worker's exit is reported
at once, since the job's survivors wait for the portal's next generation. The portal may go away
and come back: events wait in a bounded buffer meanwhile, and nothing stops the agent but a
signal, a drain or a refused token. A SIGTERM drains the node (agent.drain: its jobs move off
it in place, then the agent exits) unless `--on-term stop`; SIGINT, or a second SIGTERM, stops
the workers at once; an agent that dies (SIGKILL, a crash) leaves them training, for the next
agent to take back.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType

from agent.artifacts import ArtifactUploader
from agent.client import (
    AgentAuthError,
    PortalClient,
    PortalRejectedError,
    PortalUnavailableError,
)
from agent.code import CodeCache
from agent.commands import CommandDispatcher, CommandReader, StreamMark
from agent.devices import DeviceBackend, DeviceError, make_backend
from agent.drain import Drain, term_cause
from agent.environments import (
    Environments,
    EnvironmentSettings,
    uv_binary,
)
from agent.events import EventBuffer, PoisonIsolation
from agent.export import CheckpointExporter
from agent.isolation import make_undumpable
from agent.settings import AgentConfig, parse_config
from agent.supervisor import WorkerSupervisor
from elastic.liveness import LivenessFile
from elastic.wire import AgentReport, NodeRegistration, RegistrationReply, WorkerEvent, command_stream

log = logging.getLogger("agent")

PENDING_EVENTS = 5_000
"""Events held while the portal is away; beyond it the least useful are dropped (EventBuffer)."""
MAX_EVENTS_PER_REPORT = 1_000
MAX_RETRY_DELAY_S = 10.0
FAILURE_LOG_EVERY_S = 30.0
UNKNOWN_NODE_CODE = "unknown_node"
SWEEP_EVERY_S = 300.0
JOB_FILES_KEPT_S = 3600.0
"""How long a job's unpacked code and initial model stay on a node after its last worker here
went: a job that comes back within it (a grow onto this node) finds them."""
"""The portal's error code for a report from a node it has no record of: register again."""


class ExitCode(enum.IntEnum):
    OK = 0
    """Stopped by SIGTERM or SIGINT after stopping the workers."""
    FAILURE = 1
    """An unexpected error; the traceback is on stderr."""
    USAGE_OR_TOKEN_REFUSED = 2
    """A bad command line or setting (the usage-error convention), or the portal refused the agent
    token."""
    REGISTRATION_REJECTED = 3
    """The portal refused the registration itself (a 4xx other than 401/403)."""
    DEVICES_UNAVAILABLE = 4
    """The device backend asked for cannot run here (e.g. --backend nvml without a GPU)."""


class _FailureLog:
    """Logs a failure that repeats every interval once, then at most every FAILURE_LOG_EVERY_S,
    and the recovery once."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._failures = 0
        self._logged_at = 0.0

    def failed(self, err: Exception) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._logged_at >= FAILURE_LOG_EVERY_S:
            log.warning("%s failed (%d in a row), retrying: %s", self._what, self._failures, err)
            self._logged_at = now

    def succeeded(self) -> None:
        if self._failures:
            log.info("%s works again after %d failures", self._what, self._failures)
        self._failures = 0


class Agent:
    """One node's agent. `run` returns an ExitCode once `stopping` is set or the token is
    refused; it stops the workers before it returns."""

    def __init__(
        self,
        config: AgentConfig,
        backend: DeviceBackend,
        client: PortalClient,
        supervisor: WorkerSupervisor,
        stopping: threading.Event,
        report_now: threading.Event | None = None,
        drain: Drain | None = None,
    ) -> None:
        self.config = config
        self.drain = drain or Drain()
        self.backend = backend
        self.client = client
        self.supervisor = supervisor
        self.stopping = stopping
        isolation = supervisor.config.isolation
        self.uploader = ArtifactUploader(
            client, stopping, supervisor.state_dir, owner=isolation.uid if isolation is not None else lambda job_id: None
        )
        self.report_now = report_now or threading.Event()
        """Set (by the supervisor, on a worker's exit; by the dispatcher, when a played owner
        comes or goes) to send the next report without waiting."""
        self.code = CodeCache(client, supervisor.state_dir)
        self.environments = Environments(EnvironmentSettings(
            root=config.env_dir or supervisor.state_dir / "environments",
            python=supervisor.config.python,
            uv=uv_binary(),
            find_links=config.env_find_links,
            build_deadline_s=config.env_build_deadline_s,
            max_bytes=config.env_cache_bytes,
            index_options=config.env_index_options,
            isolation=isolation,
        ))
        self.environments.count_in_use(supervisor.standby_interpreters)
        self._dispatcher = CommandDispatcher(
            supervisor,
            backend,
            report_now=self.report_now.set,
            code=self.code,
            exporter=CheckpointExporter(
                supervisor.running, self.code, self.uploader.submit, supervisor.config.python, self.environments,
                supervisor.confined,
            ),
            drain=self.drain,
            environments=self.environments,
        )
        self._next_sweep = 0.0
        self._registration = NodeRegistration(
            name=config.node_name,
            address=config.address,
            backend=backend.name,
            devices=backend.devices(),
        )
        self._reader: CommandReader | None = None
        self._pending = EventBuffer(PENDING_EVENTS)
        self._uploads_waiting: list[WorkerEvent] = []
        self._isolation = PoisonIsolation(MAX_EVENTS_PER_REPORT)
        self._report_failures = _FailureLog("reporting to the portal")
        self.liveness = LivenessFile(config.liveness_file)

    def run(self) -> ExitCode:
        try:
            return self._run()
        finally:
            self._shut_down()

    def _run(self) -> ExitCode:
        adopted = self.supervisor.adopt()
        if adopted:
            log.info("took back %d workers an earlier agent of this node left running", len(adopted))
        self._warm_up()
        try:
            reply = self._register()
            if reply is None:
                return ExitCode.OK
            interval = self.config.report_interval_s or reply.report_interval_s
            log.info("reporting every %.3g s", interval)
            next_at = time.monotonic()
            while not self.stopping.is_set():
                self.liveness.beat()
                self.report_now.wait(max(0.0, next_at - time.monotonic()))
                self.report_now.clear()
                if self.stopping.is_set():
                    break
                next_at = max(next_at + interval, time.monotonic())
                try:
                    self._report()
                except (AgentAuthError, PortalRejectedError):
                    raise
                except Exception:
                    # A bug in one report must not take the node's workers down with the agent.
                    log.exception("a report failed unexpectedly; going on")
                if self._drained():
                    break
        except AgentAuthError as err:
            log.error("%s; check --token-file / BUNGEE_AGENT_TOKEN_FILE. Exiting.", err)
            return ExitCode.USAGE_OR_TOKEN_REFUSED
        except PortalRejectedError as err:
            log.error("the portal refused the registration: %s. Exiting.", err)
            return ExitCode.REGISTRATION_REJECTED
        return ExitCode.OK

    # --- draining ----------------------------------------------------------------------------

    def _drained(self) -> bool:
        """Whether a drain is over: every worker here gone and its exit reported (the agent then
        leaves), or the deadline passed (it stops what is left on its way out)."""
        notice = self.drain.notice
        if notice is None:
            return False
        if self.drain.overdue():
            running = self.supervisor.running()
            log.warning("the drain's deadline passed with %d worker(s) still here: stopping them", len(running))
            return True
        return self.supervisor.idle() and not len(self._pending)

    # --- registration ------------------------------------------------------------------------

    def _register(self) -> RegistrationReply | None:
        """Registers until the portal answers and follows the stream it names; returns its
        reply, or None if told to stop first. Raises AgentAuthError, PortalRejectedError."""
        failures = _FailureLog(f"registering with {self.client.base_url}")
        delay = 0.5
        while not self.stopping.is_set():
            self.liveness.beat()
            if self.drain.notice is not None and self.supervisor.idle():
                log.info("drained before the portal answered: nothing here to move")
                return None
            known_url: str | None
            if self._reader is not None:
                known_url, known_stream = self._reader.redis_url, self._reader.stream
            else:
                known_url, known_stream = self.config.redis_url, command_stream(self.config.node_name)
            mark = StreamMark.take(known_url, known_stream)
            registration = self._registration.model_copy(update={"running": self.supervisor.running()})
            try:
                reply = self.client.register(registration)
            except PortalUnavailableError as err:
                failures.failed(err)
                self.stopping.wait(delay)
                delay = min(2 * delay, MAX_RETRY_DELAY_S)
                continue
            failures.succeeded()
            log.info(
                "registered node %r (id %d) with %d %s devices",
                self.config.node_name,
                reply.node_id,
                len(self._registration.devices),
                self.backend.name,
            )
            self._follow(reply, mark)
            return reply
        return None

    def _follow(self, reply: RegistrationReply, mark: StreamMark) -> None:
        """Reads the stream the reply names from `mark` on, unless already reading it."""
        url = self.config.redis_url or reply.commands_redis_url
        stream = reply.commands_stream
        if self._reader is not None:
            if (self._reader.redis_url, self._reader.stream) == (url, stream):
                return
            self._reader.stop()
        self._reader = CommandReader(url, stream, mark, self._dispatcher.dispatch)
        self._reader.start()

    def _warm_up(self) -> None:
        """Starts the node's standbys (and its fork server's imports) before it registers, on the
        devices no owner uses: a node that has just arrived is asked for a worker as soon as it
        is registered, and that worker then finds them under way (a standby still starting, or
        a fork server halfway through its imports) rather than importing torch from scratch."""
        ours: dict[int, tuple[int | None, int]] = {
            w.pid: (w.job_id, w.device_index) for w in self.supervisor.running() if w.pid is not None
        }
        try:
            samples = self.backend.sample(ours)
        except DeviceError as err:
            log.warning("could not sample the devices: %s", err)
            return
        self.supervisor.keep_standbys(self.backend, {s.index for s in samples if s.owner_present})

    # --- reports -----------------------------------------------------------------------------

    def _report(self) -> None:
        """Sends one report. Raises AgentAuthError, and PortalRejectedError if registering
        again is refused."""
        # Standbys before running workers: a standby a launch takes in between is in one or the
        # other (the spawner tells it as a standby until the worker is listed), never an unknown
        # process on its device, which would read as its owner's return.
        ours: dict[int, tuple[int | None, int]] = {
            pid: (None, index) for pid, index in self.supervisor.standby_pids().items()
        }
        # Running workers before events: a worker that exits in between is listed as running
        # and its exit is in the same report, never missing from both.
        running = self.supervisor.running()
        self._sweep({worker.job_id for worker in running})
        ours.update((w.pid, (w.job_id, w.device_index)) for w in running)
        try:
            samples = self.backend.sample(ours)
        except DeviceError as err:
            log.warning("could not sample the devices: %s", err)
            samples = []
        else:
            # After the reading: a device whose owner came back loses its standby at once, and a
            # draining node keeps none.
            taken = {s.index for s in samples if s.owner_present or self.drain.notice is not None}
            self.supervisor.keep_standbys(self.backend, taken)
        self._pending.extend(self._uploads_taken(self.supervisor.drain_events()))
        events = self._pending.peek(self._isolation.batch_size())
        report = AgentReport(
            node=self.config.node_name, samples=samples, events=events, running=running, drain=self.drain.notice
        )
        try:
            refused = self.client.report(report)
        except PortalUnavailableError as err:
            self._report_failures.failed(err)
            if err.status is not None and err.status >= 500:
                poison = self._isolation.server_failed(events)
                for event in poison:
                    log.error("dropping an event the portal failed on %d times while it took reports without it: %s",
                              self._isolation.tries, event.model_dump_json()[:500])
                self._pending.remove(poison)
            return
        except PortalRejectedError as err:
            if err.code == UNKNOWN_NODE_CODE:
                log.warning("the portal does not know this node any more (%s): registering again", err)
                self._register()
                return
            log.error("the portal refused a report, dropping its %d events: %s", len(events), err)
            self._pending.remove(events)
            self._delivered()
            return
        self._report_failures.succeeded()
        self._isolation.succeeded(events)
        for item in refused:
            log.error("the portal refused %s of a report (not stored): %s", item.get("item"), item.get("message"))
        self._pending.remove(events)
        self._delivered()

    def _sweep(self, live_jobs: set[int]) -> None:
        """Every SWEEP_EVERY_S, deletes the per-job copies (code, initial model) of jobs with no
        worker here for JOB_FILES_KEPT_S."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY_S
        for job_id in self.code.sweep(live_jobs, JOB_FILES_KEPT_S):
            log.info("deleted the files of job %d: no worker of it here for %.0f s", job_id, JOB_FILES_KEPT_S)

    def _uploads_taken(self, events: list[WorkerEvent]) -> list[WorkerEvent]:
        """Keeps "artifacts" events for the uploader (the upload tells the portal) until the
        events drained before them have reached the portal (`_delivered`): the portal takes a
        job's artifacts only from a node it knows the job ran on, which it learns from those
        events. A worker from a warm standby can finish a short job before the next report.
        Returns the other events, to be reported."""
        self._uploads_waiting += [event for event in events if event.kind == "artifacts"]
        return [event for event in events if event.kind != "artifacts"]

    def _delivered(self) -> None:
        """Once every event handed over has reached the portal: tells the supervisor, so that its
        records move on (what a restarted agent would report again), and starts the uploads
        that waited for them."""
        if not len(self._pending):
            self.supervisor.events_delivered()
            uploads, self._uploads_waiting = self._uploads_waiting, []
            for event in uploads:
                self.uploader.submit(event)

    # --- shutdown ----------------------------------------------------------------------------

    def _shut_down(self) -> None:
        if self._reader is not None:
            # Without waiting for its blocking read (up to a second): a drained agent leaves as
            # soon as its last report is sent, and an owner's job waits for that.
            self._reader.stop(timeout_s=0)
        running = self.supervisor.running()
        if running:
            log.info("stopping %d workers", len(running))
        self.supervisor.shutdown()
        self._pending.extend(self._uploads_taken(self.supervisor.drain_events()))
        leaving = self.drain.notice is not None
        if len(self._pending) or leaving:
            # One try, so that the portal learns of the exits now rather than by timeout, and
            # of a drained node's leaving.
            events = self._pending.peek(MAX_EVENTS_PER_REPORT)
            try:
                self.client.report(AgentReport(
                    node=self.config.node_name, events=events, drain=self.drain.notice, leaving=leaving
                ))
            except (PortalUnavailableError, PortalRejectedError, AgentAuthError) as err:
                log.warning("could not send the final report (the next agent sends it): %s", err)
            else:
                self._pending.remove(events)
                self._delivered()
        self.backend.close()
        self.client.close()
        self._remove_state_dir()
        log.info("agent stopped")

    def _remove_state_dir(self) -> None:
        """Removes the state directory of a Slurm job's node once it drained (no later agent
        serves that node: its name holds the job's id, and a job that leaves on its own is not
        requeued) with no worker left and no upload waiting in it. Anywhere else the next agent
        of the node takes over what it holds."""
        state_dir = self.supervisor.state_dir
        if not self.config.state_dir_of_one_job or self.drain.notice is None or self.supervisor.running():
            return
        if any((state_dir / "pending-artifacts").glob("job-*.json")):
            log.warning("keeping %s: artifacts wait there for an upload", state_dir)
            return
        try:
            shutil.rmtree(state_dir)
        except OSError as err:
            log.warning("could not remove the node's state directory %s: %s", state_dir, err)
        else:
            log.info("removed the node's state directory %s", state_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the agent; returns its ExitCode."""
    # First: from here on no process of the agent's uid without CAP_SYS_PTRACE (a job's, where
    # jobs run as the agent's user) reads its memory or its environment, which may hold its token.
    make_undumpable()
    config = parse_config(argv, os.environ)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: one line a second per agent says nothing.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stopping = threading.Event()
    report_now = threading.Event()
    drain = Drain()
    terms: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and config.on_term == "drain" and not terms:
            terms.append(signum)
            # What the TERM means may ask Slurm (squeue, bounded): not in the handler.
            threading.Thread(target=start_drain, args=(time.monotonic(),), name="drain", daemon=True).start()
            return
        log.info("%s: stopping", signal.Signals(signum).name)
        stopping.set()
        report_now.set()

    def start_drain(term_at: float) -> None:
        lead = config.slurm_signal_s if config.slurm_signal_s is not None else config.drain_deadline_s
        cause = term_cause(config.slurm_job_id, os.environ, lead)
        # The deadline counts from the TERM: the time squeue took is spent.
        drain.ask(cause, max(0.0, config.drain_deadline_s - (time.monotonic() - term_at)))
        report_now.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        backend = make_backend(
            config.backend, slots=config.sim_devices, node_name=config.node_name, pace=config.sim_pace,
            gpus=config.gpus,
        )
    except DeviceError as err:
        log.error("device backend %r cannot start: %s", config.backend, err)
        return ExitCode.DEVICES_UNAVAILABLE
    supervisor = WorkerSupervisor(config.supervisor_config(), on_exit=report_now.set)
    client = PortalClient(config.portal_url, config.token, state_dir=config.state_dir)
    agent = Agent(config, backend, client, supervisor, stopping, report_now, drain)
    return agent.run()
