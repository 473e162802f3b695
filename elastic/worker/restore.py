"""Entering a generation with the training state: once the group is formed
(elastic.worker.rendezvous), the members learn who holds the newest state; the joiners receive
it from the holders' memory, split across them (elastic.worker.transfer); with no holder, rank 0
restores the periodic checkpoint and sends it the same way, or the job starts from step 0. A
generation with a donor (a holder that is not a member) forms twice: once with the donor to move
the state, once without it to train. A generation whose members are exactly the group's is only
relabelled: nothing is formed or moved."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.spec import JobSpec
from elastic.wire import Membership
from elastic.worker import LEFT_EXIT_CODE, WorkerExit
from elastic.worker.checkpoint import TrainingState, load_checkpoint
from elastic.worker.events import EventWriter
from elastic.worker.hybrid import HybridTrainer
from elastic.worker.loop import CheckpointSaver, ResizeMeter
from elastic.worker.position import WorkerPosition
from elastic.worker.rendezvous import GroupInfo, Rendezvous, RendezvousError
from elastic.worker.settings import WorkerSettings
from elastic.worker.trainer import SampleRecorder, Trainer
from elastic.worker.transfer import StateOutline, apply_outline, move_state, outline, state_tensors


def relayed(route: str, record: Membership) -> bool:
    """Whether the state of generation `record` goes down chains of the joiners rather than
    from the sources to each, for the setting `route` ("auto", "relay" or "direct"). Auto
    relays only when the group (its donor included) spans several nodes: a chain sends each
    chunk over the sources' links once, whatever the number of joiners. On one node every byte
    is a copy through loopback on the same cores either way, and there the chain's forwarding
    made two joiners' transfer 2.36x one joiner's against 1.49x sent to each
    (bench/results/resize-routes-barrier-cpu-2core-amd-2026-11-26.txt)."""
    if route != "auto":
        return route == "relay"
    members = [*record.members, *([record.donor] if record.donor is not None else [])]
    return len({member.node for member in members}) > 1


def newest_holders(infos: list[GroupInfo]) -> list[int]:
    """The ranks that hold the newest training state (the most steps), or [] if none holds any."""
    holders = [rank for rank, info in enumerate(infos) if info.holds_state]
    if not holders:
        return []
    newest = max(infos[rank].step for rank in holders)
    return [rank for rank in holders if infos[rank].step == newest]


class StateRestore:
    """Takes this worker (where it stands: `position`) into each generation with the training
    state of `model`, `optimizer` and the consistency mode's `trainer`. `checkpoint` is the job's
    periodic checkpoint, which must be of `spec`; `resizes` hears of every entry and `saver` of a
    new rank 0."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        position: WorkerPosition,
        events: EventWriter,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: Trainer,
        recorder: SampleRecorder | None,
        checkpoint: Path,
        spec: JobSpec,
        settings: WorkerSettings,
        resizes: ResizeMeter,
        saver: CheckpointSaver,
        touched: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.position = position
        self.events = events
        self.model = model
        self.optimizer = optimizer
        self.trainer = trainer
        self.recorder = recorder
        self.checkpoint = checkpoint
        self.spec = spec
        self.total_steps = spec.total_steps()
        self.settings = settings
        self.resizes = resizes
        self.saver = saver
        self.device = rendezvous.device
        self.me = rendezvous.me
        self.touched = touched
        """Memory made ahead for the optimiser state this worker may receive at its first
        switch (elastic.worker.transfer.touched_like); dropped after that switch."""

    def enter(self, record: Membership) -> None:
        """Forms `record`'s group and brings every member the training state. Raises
        RendezvousError if a member does not come, WorkerExit for a donor once it handed over."""
        position = self.position
        started = time.perf_counter()
        before = position.membership
        if before is not None and record.donor is None and record.keys() == before.keys():
            self.relabel(record)
            return
        self.rendezvous.leave_group()
        is_donor = record.donor is not None and record.donor.key == self.me
        world = record.world_size + (1 if record.donor is not None else 0)
        rank = record.world_size if is_donor else record.rank_of(self.me)
        assert rank is not None
        running = position.holds_state or record.has_state
        self.rendezvous.form(
            record,
            rank,
            world,
            "switch",
            self.settings.rendezvous_timeout_s if running else self.settings.pg_timeout_s,
        )
        formed = time.perf_counter()
        infos = self.rendezvous.exchange(self._info())
        exchanged = time.perf_counter()
        sources, how = self.sources(infos, rank)
        receivers = [r for r in range(world) if r not in sources]
        bytes_moved = 0
        if sources and receivers:
            source_outline = infos[sources[0]].outline
            if rank in receivers:
                assert source_outline is not None
                self.receive_outline(source_outline)
            tensors = state_tensors(self.model, self.optimizer, self.device) + self.trainer.bulk_state()
            try:
                moved = move_state(
                    tensors, sources, receivers, rank, relay=relayed(self.settings.state_route, record)
                )
            except RuntimeError as err:
                raise RendezvousError(f"the state transfer failed: {err}") from err
            bytes_moved = moved.bytes_moved
            if rank in receivers:
                self.trainer.state_arrived()
        transferred = time.perf_counter()
        self.touched = None  # used up, or never to be: a worker receives at its first switch only
        if record.donor is not None:
            self.rendezvous.leave_group()
            if is_donor:
                raise WorkerExit(
                    LEFT_EXIT_CODE,
                    f"handed the state of step {position.step} to generation {record.generation} and left",
                )
            self.rendezvous.form(record, rank, record.world_size, "train", self.settings.rendezvous_timeout_s)
        position.holds_state = True
        self.adopt(record, rank)
        holders = [info for info in infos if info.holds_state and info.step == position.step]
        last_end = (
            position.last_step_end if rank in sources else (holders[0].last_step_end if holders else None)
        )
        phases = {
            "rendezvous": formed - started,
            "exchange": exchanged - formed,
            "transfer": transferred - exchanged,
        }
        if self.resizes.switch_started is not None and before is not None:
            phases["leave"] = started - self.resizes.switch_started
        self.resizes.switch_started = None
        self.resizes.announce(
            record,
            how,
            before_group=next((i.group for i in infos if i.holds_state), []),
            step=position.step,
            rank=position.rank,
            bytes_moved=bytes_moved,
            phases=phases,
            last_step_end=last_end,
            sources=len(sources) if receivers else 0,
        )

    def _info(self) -> GroupInfo:
        position = self.position
        return GroupInfo(
            holds_state=position.holds_state,
            step=position.step,
            group=position.group if position.holds_state else [],
            last_step_end=position.last_step_end,
            outline=self.outline() if position.holds_state else None,
        )

    def sources(self, infos: list[GroupInfo], rank: int) -> tuple[list[int], str]:
        """Returns the ranks of the group just formed that hold the newest state, restoring it
        first where none does, and how the state came: "memory", "checkpoint" or "fresh". A
        collective call. Raises RendezvousError if rank 0 cannot share the checkpoint's outline,
        CheckpointError if the checkpoint is not this job's."""
        holders = newest_holders(infos)
        if holders:
            return holders, "memory"
        state = load_checkpoint(self.checkpoint) if rank == 0 else None
        if state is not None:
            self.restore_checkpoint(state)
        box: list[StateOutline | None] = [self.outline() if state is not None else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:
            raise RendezvousError(f"rank 0 could not share the checkpoint's outline: {err}") from err
        shared = box[0]
        if shared is None:
            self.position.step = 0
            return [], "fresh"
        infos[0].outline = shared
        infos[0].holds_state = True
        infos[0].step = shared.step
        return [0], "checkpoint"

    def restore_checkpoint(self, state: TrainingState) -> None:
        """Takes on the checkpointed `state`. Raises CheckpointError if it is not this job's."""
        state.check_belongs_to(self.spec.task_name, self.spec.seed, self.total_steps)
        self.model.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        self.trainer.load_small_state(state.trainer)
        for mine, saved in zip(self.trainer.bulk_state(), state.trainer_tensors, strict=True):
            mine.copy_(saved)
        self.trainer.state_arrived()
        self.position.step = state.step

    def receive_outline(self, source: StateOutline) -> None:
        """A receiver takes on the outline of the state on its way (elastic.worker.transfer):
        the step, the mode's small values, and the optimiser's tensors ready for the bulk."""
        apply_outline(self.optimizer, source, self.device, self.touched)
        self.trainer.load_small_state(source.trainer)
        self.position.step = source.step

    def outline(self) -> StateOutline:
        """The outline of the state this worker holds, the mode's small values included."""
        state = outline(self.position.step, self.optimizer, self.device)
        state.trainer = self.trainer.small_state()
        return state

    def relabel(self, record: Membership) -> None:
        """Takes on generation `record`, which has exactly this group's members: the group and
        the state stay as they are."""
        before = self.position.group
        self.adopt(record, self.position.rank)
        self.resizes.announce(
            record,
            "memory",
            before,
            step=self.position.step,
            rank=self.position.rank,
            bytes_moved=0,
            phases={},
            last_step_end=self.position.last_step_end,
            sources=0,
        )
        self.resizes.switch_started = None

    def adopt(self, record: Membership, rank: int) -> None:
        """Becomes `rank` of generation `record`: the trainer, the sample recorder and the events
        follow; a "joined" event says so; rank 0 watches for the next generation."""
        position = self.position
        if rank == 0 and not position.is_leader:
            self.saver.restart_clock()
        position.membership = record
        position.group = record.keys()
        position.rank = rank
        if isinstance(self.trainer, HybridTrainer):
            self.trainer.rebind_members(rank, record.world_size, None, position.step, record.global_batch)
        else:
            self.trainer.rebind_members(rank, record.world_size, record.virtual_workers, position.step)
        if self.recorder is not None:
            self.recorder.rebind(record.generation, rank, record.world_size)
        self.events.rebind(record.generation, rank)
        self.events.emit("joined", pid=os.getpid())
        self.rendezvous.watch(record, rank)
