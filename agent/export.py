"""The agent's side of elastic.wire.ExportCommand: once no worker of the failed job runs on this
node, it runs `python -m elastic.worker.export` on the job's checkpoint (with the job's own code,
fetched as for a launch, in its own environment if it has one) and hands the "artifacts" event that process writes to the uploader. One
thread per command; every wait has a deadline."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agent.code import CodeCache, CodeUnavailable
from agent.environments import BuildFailed, Environments
from agent.spawn import process_environment, python_path
from elastic.requirements import RequirementsError, declared_in_directory
from elastic.wire import ExportCommand, ExportConfig, RunningWorker, WorkerEvent
from elastic.worker import EXPORT_CONFIG_ENV
from elastic.worker.event_codec import decode

log = logging.getLogger(__name__)

WORKERS_GONE_DEADLINE_S = 120.0
"""How long an export waits for the job's workers here to exit (they were told to stop)."""
EXPORT_DEADLINE_S = 900.0
"""How long the export process may take (it evaluates the task once)."""


class CheckpointExporter:
    """Runs exports for `running()`'s node; hands each "artifacts" event to `on_artifacts`."""

    def __init__(
        self,
        running: Callable[[], list[RunningWorker]],
        code: CodeCache | None,
        on_artifacts: Callable[[WorkerEvent], None],
        python: str = sys.executable,
        environments: Environments | None = None,
        confined: Callable[[int, str, list[str], Mapping[str, str]], tuple[list[str], dict[str, str]]] | None = None,
    ) -> None:
        self._environments = environments
        self._confined = confined
        """How a process of a job runs on this node (WorkerSupervisor.confined); None: as it is."""
        self._running = running
        self._code = code
        self._on_artifacts = on_artifacts
        self._python = python
        self.finished = threading.Event()
        """Set after each export ends, whatever its outcome (for tests)."""

    def _python_for(self, job_id: int, code_dir: Path) -> str | None:
        """The interpreter that can import the job's code: its environment's if it declares
        requirements (found in the node's cache, or built again), else the node's; None if that
        environment cannot be had (logged)."""
        try:
            index_options = self._environments is not None and self._environments.settings.index_options
            declared = declared_in_directory(code_dir, index_options)
            if declared is None:
                return self._python
            if self._environments is None:
                raise BuildFailed("this agent builds no environments")
            environment = self._environments.ensure(declared)
        except (RequirementsError, BuildFailed) as err:
            log.error("job %d: cannot export: its environment: %s", job_id, err)
            return None
        return str(environment.python)

    def start(self, command: ExportCommand) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(command,), name=f"export-job-{command.job_id}", daemon=True)
        thread.start()
        return thread

    def _run(self, command: ExportCommand) -> None:
        try:
            self._export(command)
        except Exception:
            log.exception("job %d: the export from its checkpoint failed", command.job_id)
        finally:
            self.finished.set()

    def _export(self, command: ExportCommand) -> None:
        deadline = time.monotonic() + WORKERS_GONE_DEADLINE_S
        while any(worker.job_id == command.job_id for worker in self._running()):
            if time.monotonic() > deadline:
                log.error("job %d: its workers here did not exit; not exporting its checkpoint", command.job_id)
                return
            time.sleep(0.2)
        python = self._python
        config = ExportConfig(
            job_id=command.job_id, generation=command.generation, spec=command.spec, run_dir=command.run_dir,
        )
        digest = command.spec.get("code")
        if digest:
            if self._code is None:
                log.error("job %d: cannot export, this agent cannot fetch code", command.job_id)
                return
            try:
                code_dir = self._code.prepare(command.job_id, str(digest))
            except CodeUnavailable as err:
                log.error("job %d: cannot export: %s", command.job_id, err)
                return
            config = config.model_copy(update={"code_dir": str(code_dir), "entrypoint": command.spec.get("entrypoint")})
            found = self._python_for(command.job_id, code_dir)
            if found is None:
                return
            python = found
        env = {**process_environment(), EXPORT_CONFIG_ENV: config.model_dump_json(), "PYTHONPATH": python_path()}
        argv = [python, "-m", "elastic.worker.export"]
        if self._confined is not None:
            try:
                argv, env = self._confined(command.job_id, command.run_dir, argv, env)
            except OSError as err:
                log.error("job %d: cannot export: its directories: %s", command.job_id, err)
                return
        try:
            done = subprocess.run(
                argv,
                env=env, capture_output=True, text=True, timeout=EXPORT_DEADLINE_S, check=False,
            )
        except subprocess.TimeoutExpired:
            log.error("job %d: the export from its checkpoint took over %.0f s", command.job_id, EXPORT_DEADLINE_S)
            return
        key = {"job_id": command.job_id, "generation": command.generation, "rank": 0}
        events = [decode(key, line) for line in done.stdout.splitlines()]
        for event in events:
            if event.kind == "log":
                log.info("job %d export: %s", command.job_id, event.message)
        exported = [event for event in events if event.kind == "artifacts"]
        if done.returncode != 0 or not exported:
            log.info("job %d: no export here (exit code %d) %s", command.job_id, done.returncode, done.stderr[-2000:])
            return
        self._on_artifacts(exported[-1])
