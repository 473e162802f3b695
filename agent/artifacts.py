"""Hands a job's artifacts (elastic.worker.artifacts) to the portal. Rank 0's "artifacts" event
names the directory; the upload runs in a thread of its own, so that reports (the node's
heartbeat) go on meanwhile. While the portal cannot take it (PortalUnavailableError) it is tried
again, with growing pauses, until UPLOAD_DEADLINE_S after the event; a refusal is logged and the
files stay on the node.

Each upload not yet done is written down under `<state_dir>/pending-artifacts` (job id,
directory, step), and crossed off once the portal took the files or refused them for good. An
agent that was stopped (or killed) mid-upload, or that gave up while the portal was away, tries
again when it starts."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from agent.client import PortalError, PortalUnavailableError
from agent.isolation import ForeignFileError, job_files
from elastic.artifacts import ARTIFACT_NAMES, is_artifacts_dir_of
from elastic.wire import WorkerEvent

log = logging.getLogger(__name__)

UPLOAD_DEADLINE_S = 900.0
FIRST_PAUSE_S = 1.0
LONGEST_PAUSE_S = 30.0


class ArtifactSink(Protocol):
    def upload_artifacts(self, job_id: int, files: dict[str, Path]) -> None: ...


class ArtifactUploader:
    def __init__(
        self, sink: ArtifactSink, stopping: threading.Event, state_dir: Path,
        owner: Callable[[int], int | None] = lambda job_id: None,
    ) -> None:
        self._sink = sink
        self._owner = owner
        """The uid that must own a job's files (where jobs are confined: agent.isolation), or None."""
        self._stopping = stopping
        self._pending = state_dir / "pending-artifacts"
        self._queue: queue.Queue[tuple[WorkerEvent, float]] = queue.Queue()
        self.uploaded: list[int] = []
        """Jobs whose artifacts the portal took, in order (for tests and logs)."""
        for event in self._left_pending():
            log.info("job %d: uploading the artifacts an earlier agent left pending", event.job_id)
            self._queue.put((event, time.monotonic() + UPLOAD_DEADLINE_S))
        self._thread = threading.Thread(target=self._run, name="artifact-uploader", daemon=True)
        self._thread.start()

    def submit(self, event: WorkerEvent) -> None:
        """Writes down, then queues, the upload of the artifacts an "artifacts" event names."""
        self._pending.mkdir(parents=True, exist_ok=True)
        note = self._note(event.job_id)
        temporary = note.with_suffix(".tmp")
        temporary.write_text(event.model_dump_json())
        os.replace(temporary, note)
        self._queue.put((event, time.monotonic() + UPLOAD_DEADLINE_S))

    def _note(self, job_id: int) -> Path:
        return self._pending / f"job-{job_id}.json"

    def _left_pending(self) -> list[WorkerEvent]:
        events = []
        for note in sorted(self._pending.glob("job-*.json")):
            try:
                events.append(WorkerEvent.model_validate(json.loads(note.read_text())))
            except (OSError, ValueError) as err:
                log.error("dropping the unreadable pending upload %s: %s", note, err)
                note.unlink(missing_ok=True)
        return events

    def _done(self, event: WorkerEvent) -> None:
        self._note(event.job_id).unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                event, deadline = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self._upload(event, deadline)

    def _upload(self, event: WorkerEvent, deadline: float) -> None:
        directory = Path(event.message or "")
        if not is_artifacts_dir_of(directory, event.job_id):  # the job's code writes the event
            log.error("job %d: %s is not the artifacts directory of a run of the job; not uploaded",
                      event.job_id, directory)
            self._done(event)
            return
        files = {name: directory / name for name in ARTIFACT_NAMES}
        missing = [name for name, path in files.items() if not path.is_file()]
        if missing:
            log.error("job %d: the artifacts in %s lack %s; not uploaded", event.job_id, directory, missing)
            self._done(event)
            return
        try:
            with job_files(directory, ARTIFACT_NAMES, self._owner(event.job_id)) as opened:
                self._upload_opened(event, opened, directory, deadline)
        except (ForeignFileError, OSError) as err:
            log.error("job %d: its artifacts in %s are not the job's own files (%s); not uploaded",
                      event.job_id, directory, err)
            self._done(event)

    def _upload_opened(self, event: WorkerEvent, files: dict[str, Path], directory: Path, deadline: float) -> None:
        pause = FIRST_PAUSE_S
        while True:
            try:
                self._sink.upload_artifacts(event.job_id, files)
            except PortalUnavailableError as err:
                if time.monotonic() + pause > deadline or self._stopping.wait(pause):
                    log.error(
                        "job %d: gave up uploading its artifacts for now (%s); they stay in %s and the next "
                        "start of this agent tries again", event.job_id, err, directory,
                    )
                    return
                pause = min(2 * pause, LONGEST_PAUSE_S)
                continue
            except PortalError as err:
                log.error("job %d: the portal refused its artifacts (%s); they stay in %s", event.job_id, err, directory)
                self._done(event)
                return
            log.info("job %d: artifacts of step %s uploaded", event.job_id, event.step)
            self._done(event)
            self.uploaded.append(event.job_id)
            return
