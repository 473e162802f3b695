"""One worker's life, across every resize of its job. The worker process is never restarted
while it is a member; it meets the others on the job's board (elastic.membership).

    build     import torch; build the model, the optimiser and the data pipeline
    join      wait for a generation that names this worker (ready, then go) and form its group
              (elastic.worker.rendezvous)
    restore   learn who holds the training state: a joiner receives it from the holders'
              memory; with no holder, rank 0 restores the periodic checkpoint, or the job starts
              from step 0 (elastic.worker.restore)
    train     step after step until the job is done, a stop is agreed, or a switch is agreed
              (elastic.worker.loop)
    switch    after the agreed step: leavers exit (LEFT_EXIT_CODE); the others form the next
              generation's group, and go back to restore
    fail      the task's own code raised (elastic.tasks.UserCodeError): its traceback goes to the
              job's log, and the worker exits with USER_ERROR_EXIT_CODE; the portal fails the job
              rather than restart it
    recover   a collective failed (a peer died or hung past the timeout): keep the state of the
              last completed step, wait for the next generation, which the portal writes once
              its agent reports the death, and form it (back to restore); the step in flight
              is done again

This module wires the parts together; the exit code says how it ended (elastic.worker)."""

from __future__ import annotations

import time
from pathlib import Path

from elastic.membership.api import Board
from elastic.spec import JobSpec
from elastic.tasks.api import UserCodeError, users_traceback
from elastic.tasks.runtime import BoundTask
from elastic.wire import UserError, WorkerConfig
from elastic.worker import (
    USER_ERROR_EXIT_CODE,
    USER_ERROR_LOG_PREFIX,
    WHOLE_TRACEBACK_HEAD,
    WorkerExit,
    build,
)
from elastic.worker.artifacts import ArtifactExporter
from elastic.worker.build import set_up_device, task_source
from elastic.worker.checkpoint import checkpoint_path
from elastic.worker.event_codec import MAX_LOG_CHARS
from elastic.worker.events import EventWriter, ProgressReporter
from elastic.worker.loop import CheckpointSaver, ResizeMeter, SwitchAgreed, TrainingLoop
from elastic.worker.position import WorkerPosition
from elastic.worker.rendezvous import Rendezvous, RendezvousError
from elastic.worker.restore import StateRestore
from elastic.worker.settings import WorkerSettings
from elastic.worker.step_clock import StepClock
from elastic.worker.stop import StopRequest
from elastic.worker.trainer import CollectiveError, SampleRecorder


def user_error_report(err: UserCodeError, directory: Path | None) -> tuple[list[str], UserError]:
    """The job's code's failure `err`, as its log lines and as the UserError its exit announces
    (which the portal quotes in the job's message): the error and the traceback of the job's own
    files (under `directory`, the task's code; None: not known) only; then, in the log only, the
    whole traceback, the platform's frames (runpy, elastic/...) with them. One log line holds
    MAX_LOG_CHARS: of a long traceback, the innermost frames."""
    head = f"{USER_ERROR_LOG_PREFIX}{err}"[: MAX_LOG_CHARS // 4]
    own = users_traceback(err, directory) if directory is not None else ""
    lines = [f"{head}\n{own[-(MAX_LOG_CHARS - len(head) - 1):]}" if own else head]
    whole = err.traceback_text.rstrip()
    if whole:
        lines.append(f"{WHOLE_TRACEBACK_HEAD}\n{whole[-(MAX_LOG_CHARS - len(WHOLE_TRACEBACK_HEAD) - 1):]}")
    return lines, UserError(error=str(err)[:2000], traceback=own[-8000:])


class WorkerRun:
    """One worker process of one job, meeting the others on `board`; `run` returns the exit
    code. The caller owns `board` (and closes it)."""

    def __init__(
        self,
        config: WorkerConfig,
        settings: WorkerSettings,
        events: EventWriter,
        stop: StopRequest,
        board: Board,
        began: float | None = None,
    ) -> None:
        self.config = config
        self.began = time.monotonic() if began is None else began
        """When the worker's process began to be this worker (time.monotonic): for its start-up line."""
        self.settings = settings
        self.events = events
        self.stop = stop
        self.spec = JobSpec(**config.spec)
        self.total_steps = self.spec.total_steps()
        self.position = WorkerPosition(rank=config.rank)
        self.rendezvous = Rendezvous(
            board, config.member_key, self.position, events, stop, settings, config.device
        )
        self.resizes = ResizeMeter(events, self.total_steps)
        self._saver: CheckpointSaver | None = None
        self._loop: TrainingLoop | None = None
        self._problem: BoundTask | None = None
        self.user_error: UserError | None = None
        """What the job's own code raised, if that ended the worker: announced with its exit."""

    def run(self) -> int:
        """Live until the job is done, a stop is agreed, or this worker leaves; return the exit
        code. Raises on any failure that is not a peer's."""
        set_up_device(self.spec, self.settings, self.rendezvous.device)
        try:
            restore, loop = self._build()
            self.stop.settle()  # from here a stop is a flag that the rendezvous and the steps read
            return self._live(restore, loop)
        except WorkerExit as way_out:
            if str(way_out):
                self.events.log(str(way_out))
            return way_out.code
        except UserCodeError as err:
            self._tell_user_error(err)
            if self._loop is not None:  # the job fails at the last step applied: the portal hears of it first
                self._loop.progress.flush()
            self._export_after_failure()
            return USER_ERROR_EXIT_CODE
        finally:
            if self._problem is not None:
                self._problem.close()
            self.rendezvous.stop_watching()
            if self._saver is not None:
                self._saver.finish()
            self.rendezvous.leave_group()

    def _tell_user_error(self, err: UserCodeError) -> None:
        try:
            directory: Path | None = task_source(self.config, self.spec)[0]
        except UserCodeError:
            directory = None
        lines, self.user_error = user_error_report(err, directory)
        for line in lines:
            self.events.log(line)

    def _export_after_failure(self) -> None:
        """Rank 0, holding the state of a completed step when the job's code failed, saves it
        and exports it as the job's artifacts (ended "failed"): what it had trained is not lost
        with the job. The state is the last completed step's: a failed step applies nothing."""
        position, saver, loop = self.position, self._saver, self._loop
        if not (position.is_leader and position.holds_state and position.step > 0 and saver and loop):
            return
        try:
            saver.save(position.step)
        except OSError as err:
            self.events.log(f"could not save the state of step {position.step} after the failure: {err}")
            return
        loop.export_now("failed")

    def _live(self, restore: StateRestore, loop: TrainingLoop) -> int:
        rendezvous = self.rendezvous
        record = rendezvous.await_generation(newer_than=self.config.generation - 1)
        while True:
            try:
                restore.enter(record)
            except RendezvousError as err:
                rendezvous.leave_group()
                self.events.emit(
                    "form_failed",
                    failed_generation=record.generation,
                    message=f"could not form generation {record.generation}: {err}",
                )
                record = rendezvous.await_generation(newer_than=record.generation)
                continue
            assert self.position.membership is not None
            try:
                ended = loop.train()
            except CollectiveError as err:
                failed = self.position.membership.generation
                self.resizes.report()  # what is known of the last switch, if it is still open
                rendezvous.leave_group()
                self.events.log(
                    f"lost a peer after step {self.position.step} in generation {failed}; holding the state of "
                    f"step {self.position.step} until the next generation ({err})"
                )
                record = rendezvous.await_generation(newer_than=failed)
                continue
            if not isinstance(ended, SwitchAgreed):
                return ended
            record = rendezvous.switch(ended.generation)

    def _build(self) -> tuple[StateRestore, TrainingLoop]:
        began = time.monotonic()
        made = build.take(self.config, self.settings)
        if made is None:
            made = build.build(self.config, self.settings)
        self._problem = problem = made.problem
        optimizer, trainer = made.optimizer, made.trainer
        recorder = (
            SampleRecorder(
                self.settings.record_samples,
                self.config.job_id,
                self.config.generation,
                self.config.rank,
                self.config.world_size,
            )
            if self.settings.record_samples is not None
            else None
        )
        clock = StepClock(
            self.events, self.settings.progress_every_s, self.settings.simulated_slowdown, self.settings.simulated_pace
        )
        trainer.recorder, trainer.compute_done = recorder, clock.compute_done
        done = time.monotonic()
        how = f"its standby had prepared it for this job ({made.describe()})" if made.prepared else made.describe()
        self.events.log(f"built in {done - began:.2f} s, {done - self.began:.2f} s after the worker began: {how}")
        progress = ProgressReporter(
            self.events,
            total_steps=self.total_steps,
            batch_size=problem.batch_size,
            samples_per_epoch=problem.num_samples,
            every_s=self.settings.progress_every_s,
        )
        self._saver = CheckpointSaver(
            checkpoint_path(self.config.run_dir), self.spec, problem.model, optimizer, trainer, self.events
        )
        restore = StateRestore(
            self.rendezvous,
            self.position,
            self.events,
            problem.model,
            optimizer,
            trainer,
            recorder,
            checkpoint_path(self.config.run_dir),
            self.spec,
            self.settings,
            self.resizes,
            self._saver,
            made.touched,
        )
        outputs = ArtifactExporter(
            self.config.run_dir,
            self.config.job_id,
            self.spec,
            problem,
            trainer,
            checkpoint_path(self.config.run_dir),
            self.events,
        )
        loop = TrainingLoop(
            trainer,
            self.position,
            clock,
            progress,
            self.events,
            self.stop,
            self._saver,
            self.resizes,
            self.total_steps,
            self.settings.checkpoint_every_s,
            pending=lambda: self.rendezvous.pending,
            export=outputs.export,
            evaluate=outputs.evaluate,
            eval_every_steps=self.spec.eval_every_steps,
        )
        self._loop = loop
        return restore, loop
