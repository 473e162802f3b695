"""One worker's life, across every resize of its job. The worker process is never restarted
while it is a member; the protocol with the portal is in elastic.membership.redis.

    build     import torch; build the model, the optimiser and the data pipeline
    join      wait for a generation that names this worker (ready, then go) and form its group
    restore   learn who holds the training state: a joiner receives it from the holders'
              memory (elastic.worker.transfer); with no holder, rank 0 restores the periodic
              checkpoint, or the job starts from step 0
    train     step after step until the job is done, a stop is agreed, or a switch is agreed
    switch    after the agreed step: leavers exit (LEFT_EXIT_CODE); the others form the next
              generation's group, and go back to restore
    recover   a collective failed (a peer died or hung past the timeout): keep the state of the
              last completed step, wait for the next generation, which the portal writes once
              its agent reports the death, and form it (back to restore); the step in flight
              is done again

The exit code says how it ended (elastic.worker)."""

from __future__ import annotations

import copy
import os
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from elastic.membership.api import Board, BoardUnavailable
from elastic.spec import JobSpec
from elastic.wire import Membership, WorkerConfig
from elastic.worker import COMPLETED_EXIT_CODE, LEFT_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, checkpoint_path, load_checkpoint, save_checkpoint
from elastic.worker.data import SampleStream, share_bounds
from elastic.worker.events import EventWriter, ProgressReporter
from elastic.worker.hybrid import HybridSchedule, HybridTrainer
from elastic.worker.settings import WorkerSettings
from elastic.worker.step_clock import StepClock
from elastic.worker.stop import StopRequest
from elastic.worker.strict import StrictTrainer
from elastic.worker.trainer import CollectiveError, SampleRecorder, Trainer
from elastic.worker.transfer import StateOutline, apply_outline, move_state, outline, state_tensors
from elastic.workloads import CATALOGUE

PAUSE_STEPS = 5
"""Steps after a switch whose median is the 'normal step' taken off the pause it reports."""
_STEP_HISTORY = 20
_GO_WAIT_S = 0.25
_LISTEN_PROBE_S = 0.002


def backend_for(device: str) -> str:
    """Return the torch.distributed backend for a WorkerConfig device: gloo for "cpu", nccl
    for "cuda:N". Raises ValueError for anything else."""
    if device == "cpu":
        return "gloo"
    if device.startswith("cuda:") and device.removeprefix("cuda:").isdigit():
        return "nccl"
    raise ValueError(f'device {device!r} is neither "cpu" nor "cuda:N"')


class RendezvousError(RuntimeError):
    """A generation's group could not be formed, or its state not restored: a member is gone."""


class _Exit(Exception):  # noqa: N818 - a way out, not an error
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Returns once something accepts TCP connections at host:port. A TCPStore client that
    comes before its server backs off for a third of a second; probing costs a few ms.
    Raises RendezvousError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise RendezvousError(f"nothing listens at {host}:{port} after {timeout_s} s: {err}") from err
            time.sleep(_LISTEN_PROBE_S)


class MembershipWatcher:
    """Rank 0's view of the board, from a thread of its own so that the training loop never
    waits on Redis: `pending` becomes the newest generation once every member of it outside the
    running group (`group`) said it is ready; 0 until then."""

    def __init__(
        self, board: Board, generation: int, group: list[str], every_s: float, events: EventWriter
    ) -> None:
        self.pending = 0
        self._board = board
        self._generation = generation
        self._group = set(group)
        self._every_s = every_s
        self._events = events
        self._stopping = threading.Event()
        self._records: dict[int, Membership] = {}
        self._thread = threading.Thread(target=self._run, name="membership-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stopping.wait(self._every_s):
            try:
                self._check()
                failures = 0
            except BoardUnavailable as err:
                failures += 1
                if failures == 1:
                    self._events.log(f"cannot read the membership board, training on: {err}")

    def _check(self) -> None:
        latest = self._board.latest_generation()
        if latest <= self._generation or latest == self.pending:
            return
        record = self._records.get(latest) or self._board.record(latest)
        if record is None:
            return
        self._records = {latest: record}
        joiners = {key for key in record.keys() if key not in self._group}
        if joiners <= self._board.ready(latest):
            self.pending = latest


@dataclass
class _GroupInfo:
    """What each member tells the others when a group forms."""

    holds_state: bool
    step: int
    group: list[str]
    """The member keys of the group it comes from (empty for a joiner)."""
    last_step_end: float | None
    """Wall-clock end of its last step in that group."""
    outline: StateOutline | None


@dataclass
class _PendingResize:
    """Rank 0's measurements of a switch, reported once a few steps show the new pace."""

    generation: int
    step: int
    members_before: list[str]
    members_after: list[str]
    bytes_moved: int
    phases: dict[str, float]
    last_step_end: float | None
    step_ends: list[float] = field(default_factory=list)


def _size(byte_count: int) -> str:
    """`byte_count` for people: 512 B, 40.0 kB, 205.0 MB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if byte_count >= size:
            return f"{byte_count / size:.1f} {unit}"
    return f"{byte_count} B"


def _detached_copy(value: Any) -> Any:
    """A copy of a state_dict (nested dicts and lists) whose tensors are CPU copies that later
    steps do not change."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _detached_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached_copy(item) for item in value)
    return value


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
    ) -> None:
        self.config = config
        self.settings = settings
        self.events = events
        self.stop = stop
        self.board = board
        self.spec = JobSpec(**config.spec)
        self.workload = CATALOGUE[self.spec.workload]
        self.hyperparameters = self.workload.hyperparameters.model_validate(self.spec.hyperparameters)
        self.total_steps = self.spec.total_steps()
        self.checkpoint = checkpoint_path(config.run_dir)
        self.me = config.member_key
        self.backend = backend_for(config.device)
        self.device = torch.device(config.device)
        self.membership: Membership | None = None
        """The generation whose group this worker is in, or None."""
        self._group_keys: list[str] = []
        """The members of the last group this worker was in."""
        self.rank = config.rank
        self.holds_state = False
        self.step = 0
        self._store: dist.TCPStore | None = None
        self._watcher: MembershipWatcher | None = None
        self._last_step_end: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)
        self._pending_resize: _PendingResize | None = None
        self._switch_started: float | None = None
        self._last_save = time.monotonic()
        self._saving: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.membership is not None and self.rank == 0

    # --- the life ----------------------------------------------------------------------------

    def run(self) -> int:
        """Live until the job is done, a stop is agreed, or this worker leaves; return the exit
        code. Raises on any failure that is not a peer's."""
        torch.set_num_threads(self.settings.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._build()
            return self._live()
        except _Exit as way_out:
            if str(way_out):
                self.events.log(str(way_out))
            return way_out.code
        finally:
            self._stop_watcher()
            self._finish_saving()
            self._leave_group()

    def _live(self) -> int:
        record = self._await_generation(newer_than=self.config.generation - 1)
        while True:
            try:
                self._enter(record)
            except RendezvousError as err:
                self._leave_group()
                self.events.emit(
                    "form_failed", failed_generation=record.generation,
                    message=f"could not form generation {record.generation}: {err}",
                )
                record = self._await_generation(newer_than=record.generation)
                continue
            assert self.membership is not None
            try:
                ended = self._train()
            except CollectiveError as err:
                failed = self.membership.generation
                self._report_resize()  # what is known of the last switch, if it is still open
                self._leave_group()
                self.events.log(
                    f"lost a peer after step {self.step} in generation {failed}; holding the state of "
                    f"step {self.step} until the next generation ({err})"
                )
                record = self._await_generation(newer_than=failed)
                continue
            if isinstance(ended, int):
                return ended
            record = ended

    def _build(self) -> None:
        problem = self.workload.build(self.hyperparameters, self.spec.seed)
        problem.model.to(self.device)
        problem.inputs = problem.inputs.to(self.device)
        problem.targets = problem.targets.to(self.device)
        problem.model.train()
        self.model = problem.model
        self.optimizer = problem.make_optimizer()
        self.recorder = (
            SampleRecorder(
                self.settings.record_samples,
                self.config.job_id,
                self.config.generation,
                self.rank,
                self.config.world_size,
            )
            if self.settings.record_samples is not None
            else None
        )
        self.clock = StepClock(self.events, self.settings.progress_every_s, self.settings.simulated_slowdown)
        self.trainer = self._make_trainer(problem)
        start, stop = share_bounds(self.hyperparameters.batch_size, self.config.world_size, self.config.rank)
        self.trainer.warm_up(stop - start)
        self.progress = ProgressReporter(
            self.events,
            total_steps=self.total_steps,
            batch_size=self.hyperparameters.batch_size,
            samples_per_epoch=self.workload.samples_per_epoch(self.hyperparameters),
            every_s=self.settings.progress_every_s,
        )

    def _make_trainer(self, problem: Any) -> Trainer:
        """The trainer of the job's consistency mode (elastic.worker.strict, .hybrid)."""
        stream = SampleStream(len(problem.inputs), self.spec.seed)
        batch_size = self.hyperparameters.batch_size
        if self.spec.consistency == "strict":
            return StrictTrainer(
                problem,
                self.optimizer,
                stream,
                batch_size=batch_size,
                seed=self.spec.seed,
                rank=self.rank,
                world_size=self.config.world_size,
                virtual_workers=self.spec.virtual_worker_count(),
                recorder=self.recorder,
                compute_done=self.clock.compute_done,
            )
        per_worker, low, high = self.spec.hybrid_batch_bounds(batch_size)
        schedule = HybridSchedule(
            base_lr=self.hyperparameters.lr,
            base_batch=batch_size,
            batch_per_worker=per_worker,
            min_batch=low,
            max_batch=high,
            lr_scaling=self.spec.lr_scaling,
            warmup_steps=self.spec.warmup_steps,
        )
        return HybridTrainer(
            problem,
            self.optimizer,
            stream,
            schedule,
            seed=self.spec.seed,
            rank=self.rank,
            world_size=self.config.world_size,
            recorder=self.recorder,
            compute_done=self.clock.compute_done,
        )

    # --- join --------------------------------------------------------------------------------

    def _await_generation(self, newer_than: int) -> Membership:
        """Returns the first record newer than `newer_than` that names this worker, once it can
        be formed: at once for a holder of the state (it wakes the joiners), after the go for a
        joiner. Raises _Exit if a record leaves this worker out or a stop is asked."""
        while True:
            record = self.board.latest()
            if record is None or record.generation <= newer_than:
                self._sleep(self.settings.membership_poll_s)
                continue
            is_donor = record.donor is not None and record.donor.key == self.me
            if record.rank_of(self.me) is None and not is_donor:
                raise _Exit(
                    LEFT_EXIT_CODE, f"left the job: generation {record.generation} does not name {self.me}"
                )
            if self.holds_state:
                joiners = {member.key for member in record.members if member.joiner}
                if not self._await_ready(record.generation, joiners):
                    newer_than = record.generation
                    continue
                self.board.send_go(record.generation, len(joiners))
                return record
            self.board.mark_ready(record.generation, self.me)
            if not record.has_state:
                return record
            while True:
                self._check_stop()
                if self.board.wait_go(record.generation, _GO_WAIT_S):
                    return record
                if self.board.latest_generation() > record.generation:
                    newer_than = record.generation
                    break

    def _await_ready(self, generation: int, joiners: set[str]) -> bool:
        """A holder of the state waits until every joiner of `generation` said it is ready
        (a joiner may still be importing torch), so that the group it forms next does not
        time out on a member that is merely slow. Returns False as soon as a newer generation
        is published instead: the portal expires a generation whose joiners are not ready by
        its deadline (elastic.membership.GenerationPhase) and plans one without them."""
        announced = False
        while not joiners <= self.board.ready(generation):
            if self.board.latest_generation() > generation:
                return False
            if not announced:
                self._log_any(f"waiting for {len(joiners)} joiner(s) of generation {generation} to warm up")
                announced = True
            self._sleep(self.settings.membership_poll_s)
        return True

    def _sleep(self, seconds: float) -> None:
        self._check_stop()
        time.sleep(seconds)

    def _check_stop(self) -> None:
        if self.stop.requested:
            where = "between generations" if self.holds_state else "before training"
            raise _Exit(STOPPED_EXIT_CODE, f"stopped {where}")

    # --- forming a generation ----------------------------------------------------------------

    def _enter(self, record: Membership) -> None:
        """Forms `record`'s group and brings every member the training state. Raises
        RendezvousError if a member does not come, _Exit for a donor once it handed over."""
        started = time.perf_counter()
        before = self.membership
        if before is not None and record.donor is None and record.keys() == before.keys():
            self._relabel(record)
            return
        self._leave_group()
        is_donor = record.donor is not None and record.donor.key == self.me
        world = record.world_size + (1 if record.donor is not None else 0)
        rank = record.world_size if is_donor else record.rank_of(self.me)
        assert rank is not None
        running = self.holds_state or record.has_state
        self._form(
            record,
            rank,
            world,
            "switch",
            self.settings.rendezvous_timeout_s if running else self.settings.pg_timeout_s,
        )
        formed = time.perf_counter()
        infos = self._exchange()
        exchanged = time.perf_counter()
        sources, how = self._sources(infos, rank)
        receivers = [r for r in range(world) if r not in sources]
        bytes_moved = 0
        if sources and receivers:
            source_outline = infos[sources[0]].outline
            if rank in receivers:
                assert source_outline is not None
                apply_outline(self.optimizer, source_outline, self.device)
                self.trainer.load_small_state(source_outline.trainer)
                self.step = source_outline.step
            tensors = state_tensors(self.model, self.optimizer, self.device) + self.trainer.bulk_state()
            try:
                moved = move_state(tensors, sources, receivers, rank)
            except RuntimeError as err:
                raise RendezvousError(f"the state transfer failed: {err}") from err
            bytes_moved = moved.bytes_moved
            if rank in receivers:
                self.trainer.state_arrived()
        transferred = time.perf_counter()
        if record.donor is not None:
            self._leave_group()
            if is_donor:
                raise _Exit(
                    LEFT_EXIT_CODE,
                    f"handed the state of step {self.step} to generation {record.generation} and left",
                )
            self._form(record, rank, record.world_size, "train", self.settings.rendezvous_timeout_s)
        self.holds_state = True
        self._adopt(record, rank)
        holders = [info for info in infos if info.holds_state and info.step == self.step]
        last_end = self._last_step_end if rank in sources else (holders[0].last_step_end if holders else None)
        phases = {
            "rendezvous": formed - started,
            "exchange": exchanged - formed,
            "transfer": transferred - exchanged,
        }
        if self._switch_started is not None and before is not None:
            phases["leave"] = started - self._switch_started
        self._switch_started = None
        self._announce(
            record,
            how,
            before_group=next((i.group for i in infos if i.holds_state), []),
            bytes_moved=bytes_moved,
            phases=phases,
            last_step_end=last_end,
            sources=len(sources) if receivers else 0,
        )

    def _form(self, record: Membership, rank: int, world: int, phase: str, timeout_s: float) -> None:
        """Joins generation `record`'s process group as `rank` of `world`; the store is rank 0's,
        at the record's master address and port. Raises RendezvousError after `timeout_s`."""
        timeout = timedelta(seconds=timeout_s)
        try:
            if phase == "switch" or self._store is None:
                if rank != 0:
                    wait_listening(record.master_addr, record.master_port, timeout_s)
                self._store = dist.TCPStore(
                    record.master_addr,
                    record.master_port,
                    world,
                    rank == 0,
                    timeout=timeout,
                    wait_for_workers=False,
                )
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"g{record.generation}/{phase}", self._store),
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=self.device if self.device.type == "cuda" else None,
            )
            # Forming waits `timeout_s` for the members; a step waits the group's own timeout.
            _set_pg_timeout(timedelta(seconds=self.settings.pg_timeout_s))
        except RendezvousError:
            raise
        except (RuntimeError, ValueError) as err:  # DistStoreError, DistNetworkError included
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RendezvousError(str(err)) from err

    def _exchange(self) -> list[_GroupInfo]:
        mine = _GroupInfo(
            holds_state=self.holds_state,
            step=self.step,
            group=self._group_keys if self.holds_state else [],
            last_step_end=self._last_step_end,
            outline=self._outline() if self.holds_state else None,
        )
        infos: list[Any] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(infos, mine)
        except RuntimeError as err:
            raise RendezvousError(f"the members could not exchange their state: {err}") from err
        return infos

    def _sources(self, infos: list[_GroupInfo], rank: int) -> tuple[list[int], str]:
        """Returns the ranks that hold the newest state, restoring it first where none does,
        and how the state came: "memory", "checkpoint" or "fresh"."""
        holders = [r for r, info in enumerate(infos) if info.holds_state]
        if holders:
            newest = max(infos[r].step for r in holders)
            return [r for r in holders if infos[r].step == newest], "memory"
        state = load_checkpoint(self.checkpoint) if rank == 0 else None
        if state is not None:
            state.check_belongs_to(self.spec.workload, self.spec.seed, self.total_steps)
            self.model.load_state_dict(state.model)
            self.optimizer.load_state_dict(state.optimizer)
            self.trainer.load_small_state(state.trainer)
            for mine, saved in zip(self.trainer.bulk_state(), state.trainer_tensors, strict=True):
                mine.copy_(saved)
            self.trainer.state_arrived()
            self.step = state.step
        box: list[Any] = [self._outline() if state is not None else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:
            raise RendezvousError(f"rank 0 could not share the checkpoint's outline: {err}") from err
        if box[0] is None:
            self.step = 0
            return [], "fresh"
        infos[0].outline = box[0]
        infos[0].holds_state = True
        infos[0].step = box[0].step
        return [0], "checkpoint"

    def _outline(self) -> StateOutline:
        """The outline of the state this worker holds, the mode's small values included."""
        state = outline(self.step, self.optimizer, self.device)
        state.trainer = self.trainer.small_state()
        return state

    def _relabel(self, record: Membership) -> None:
        """Takes on generation `record`, which has exactly this group's members: the group and
        the state stay as they are."""
        before = self._group_keys
        self._adopt(record, self.rank)
        self._announce(
            record, "memory", before, bytes_moved=0, phases={}, last_step_end=self._last_step_end, sources=0
        )
        self._switch_started = None

    def _adopt(self, record: Membership, rank: int) -> None:
        if rank == 0 and not self.is_leader:
            self._last_save = time.monotonic()
        self.membership = record
        self._group_keys = record.keys()
        self.rank = rank
        if isinstance(self.trainer, HybridTrainer):
            self.trainer.rebind_members(rank, record.world_size, None, self.step, record.global_batch)
        else:
            self.trainer.rebind_members(rank, record.world_size, record.virtual_workers, self.step)
        if self.recorder is not None:
            self.recorder.rebind(record.generation, rank, record.world_size)
        self.events.rebind(record.generation, rank)
        self.events.emit("joined", pid=os.getpid())
        self._stop_watcher()
        if rank == 0:
            self._watcher = MembershipWatcher(
                self.board, record.generation, record.keys(), self.settings.membership_poll_s, self.events
            )

    def _announce(
        self,
        record: Membership,
        how: str,
        before_group: list[str],
        bytes_moved: int,
        phases: dict[str, float],
        last_step_end: float | None,
        sources: int,
    ) -> None:
        if self.rank != 0:
            return
        where = f"step {self.step} of {self.total_steps}, world size {record.world_size}"
        if how == "fresh":
            self.events.log(f"starting from step 0 of {self.total_steps}, world size {record.world_size}")
        elif how == "checkpoint":
            self.events.log(
                f"resumed from the periodic checkpoint at {where}: no running worker held the training state"
            )
        else:
            moved = f"{_size(bytes_moved)} from {sources} holder(s)" if bytes_moved else "nothing to move"
            self.events.log(
                f"generation {record.generation}: {len(before_group)} -> {record.world_size} workers at {where}; {moved}"
            )
        self._pending_resize = _PendingResize(
            generation=record.generation,
            step=self.step,
            members_before=before_group,
            members_after=record.keys(),
            bytes_moved=bytes_moved,
            phases=phases,
            last_step_end=last_step_end if how == "memory" else None,
        )

    def _leave_group(self) -> None:
        """Leaves the current process group, if any; the training state stays."""
        self._stop_watcher()
        self.membership = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                self.events.log(f"could not tear down the old process group cleanly: {err}")

    def _stop_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    # --- training ----------------------------------------------------------------------------

    def _train(self) -> int | Membership:
        """Trains from self.step; returns the exit code when the job is done or stopped, or the
        record of the generation every member switches to. Raises CollectiveError."""
        while self.step < self.total_steps:
            switch_to = self._watcher.pending if self._watcher is not None else 0
            began = time.perf_counter()
            self.clock.start()
            outcome = self.trainer.step(self.step, self.stop.requested, switch_to)
            self.clock.report(generation_changed=bool(outcome.switch_to))
            self._step_seconds.append(time.perf_counter() - began)
            self._last_step_end = time.time()
            self.step = outcome.step
            finished = self.step == self.total_steps
            if self.is_leader:
                self.progress.step_done(
                    self.step,
                    outcome.loss,
                    outcome.samples,
                    force=finished or outcome.stop or bool(outcome.switch_to),
                    global_batch=self.trainer.batch_size,
                    lr=self.trainer.lr,
                    samples_done=self.trainer.batch_start(self.step),
                )
                self._measure_resize(finished or bool(outcome.switch_to))
            if finished:
                break
            if outcome.stop:
                self._log(f"stopping at step {self.step}")
                self._save_and_wait()
                return STOPPED_EXIT_CODE
            if outcome.switch_to:
                return self._switch(outcome.switch_to)
            if self.is_leader and time.monotonic() - self._last_save >= self.settings.checkpoint_every_s:
                self._save(background=True)
        self._log(f"completed all {self.total_steps} steps")
        self._save_and_wait()
        return COMPLETED_EXIT_CODE

    def _switch(self, generation: int) -> Membership:
        """After the agreed step: returns the record to form, or raises _Exit for a leaver."""
        self._switch_started = time.perf_counter()
        self._stop_watcher()
        record = self.board.record(generation)
        if record is None:
            raise RuntimeError(f"generation {generation} was agreed but its record is gone")
        if self.rank == 0:
            joiners = [key for key in record.keys() if key not in self._group_keys]
            self.board.send_go(generation, len(joiners))
        is_donor = record.donor is not None and record.donor.key == self.me
        if record.rank_of(self.me) is None and not is_donor:
            self._leave_group()
            raise _Exit(
                LEFT_EXIT_CODE,
                f"left the job at step {self.step}: generation {generation} does not name {self.me}",
            )
        return record

    def _measure_resize(self, now: bool) -> None:
        """Reports the last switch once PAUSE_STEPS steps after it (or `now`) give the pace."""
        pending = self._pending_resize
        if pending is None:
            return
        assert self._last_step_end is not None
        pending.step_ends.append(self._last_step_end)
        if len(pending.step_ends) > PAUSE_STEPS or now:
            self._report_resize()

    def _report_resize(self) -> None:
        """Emits the "resized" event of the last switch, if not done yet: its pause is known
        once a step after it ended."""
        pending = self._pending_resize
        if pending is None:
            return
        self._pending_resize = None
        ends = pending.step_ends
        pause = None
        if pending.last_step_end is not None and ends:
            steps = [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)]
            normal = statistics.median(steps) if steps else statistics.median(self._step_seconds)
            pause = max(0.0, ends[0] - pending.last_step_end - normal)
            pending.phases["first_step"] = ends[0] - pending.last_step_end - sum(pending.phases.values())
        self.events.emit(
            "resized",
            step=pending.step,
            members_before=pending.members_before,
            members_after=pending.members_after,
            pause_s=pause,
            bytes_moved=pending.bytes_moved,
            phases={name: round(seconds, 6) for name, seconds in pending.phases.items()},
        )

    # --- checkpoints -------------------------------------------------------------------------

    def _save(self, background: bool = False) -> None:
        """Writes the state after the current step to the periodic checkpoint. In the
        background, the step only pays for a copy of the state in memory; the file is written
        and synced by a thread while training goes on (one write at a time)."""
        self._finish_saving()
        state = TrainingState(
            step=self.step,
            workload=self.spec.workload,
            seed=self.spec.seed,
            model=_detached_copy(self.model.state_dict()),
            optimizer=_detached_copy(self.optimizer.state_dict()),
            trainer=copy.deepcopy(self.trainer.small_state()),
            trainer_tensors=[_detached_copy(tensor) for tensor in self.trainer.bulk_state()],
        )
        self._last_save = time.monotonic()
        if not background:
            save_checkpoint(self.checkpoint, state)
            return
        self._saving = threading.Thread(
            target=self._write_checkpoint, args=(state,), name="checkpoint-writer", daemon=True
        )
        self._saving.start()

    def _write_checkpoint(self, state: TrainingState) -> None:
        try:
            save_checkpoint(self.checkpoint, state)
        except OSError as err:
            self.events.log(f"could not write the periodic checkpoint of step {state.step}: {err}")

    def _finish_saving(self) -> None:
        """Waits for the background write in flight, if any."""
        if self._saving is not None:
            self._saving.join()
            self._saving = None

    def _save_and_wait(self) -> None:
        """Rank 0 saves the state after the current step; then every rank waits until it has."""
        if self.is_leader:
            self._save()
        try:
            dist.barrier()
        except RuntimeError as err:
            raise CollectiveError(f"the barrier after saving failed: {err}") from err

    def _log(self, message: str) -> None:
        if self.is_leader:
            self.events.log(message)

    def _log_any(self, message: str) -> None:
        """Logs `message` from the lowest-ranked holder only (rank 0 of the last group)."""
        if self.rank == 0:
            self.events.log(message)
