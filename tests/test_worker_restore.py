"""Entering a generation with the training state (elastic.worker.restore), in this process: a
group of one forms over gloo and starts fresh, or from the periodic checkpoint; a checkpoint of
another job is refused; a generation with the same members is only relabelled; a receiver takes
on the outline of the state on its way; the newest holders are the sources; a new rank 0 counts
to its first periodic save from the moment it became rank 0."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.wire import Member, Membership, WorkerEvent
from elastic.worker.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from elastic.worker.event_codec import decode
from elastic.worker.events import EventWriter
from elastic.worker.local import free_port
from elastic.worker.loop import CheckpointSaver, ResizeMeter
from elastic.worker.position import WorkerPosition
from elastic.worker.rendezvous import GroupInfo, Rendezvous
from elastic.worker.restore import StateRestore, newest_holders, relayed
from elastic.worker.settings import WorkerSettings
from elastic.worker.stop import StopRequest
from elastic.worker.transfer import StateOutline
from tests.membership_support import MemoryBoard, key, record
from tests.test_worker_events import CONFIG
from tests.test_worker_loop import SPEC, TOTAL_STEPS

SETTINGS = WorkerSettings(membership_poll_s=3600.0, rendezvous_timeout_s=30.0, pg_timeout_s=30.0)


class StateTrainer:
    """The parts of a trainer that the restore uses: its small and bulk state, and its rank."""

    def __init__(self) -> None:
        self.small: dict[str, Any] = {"position": 0}
        self.context = torch.zeros(3)
        self.arrivals = 0
        self.rebound: list[tuple[int, int, list[int] | None, int]] = []

    def small_state(self) -> dict[str, Any]:
        return dict(self.small)

    def load_small_state(self, state: dict[str, Any]) -> None:
        self.small = dict(state)

    def bulk_state(self) -> list[torch.Tensor]:
        return [self.context]

    def state_arrived(self) -> None:
        self.arrivals += 1

    def rebind_members(self, rank: int, world_size: int, shares: list[int] | None, step: int) -> None:
        self.rebound.append((rank, world_size, shares, step))


class Worker:
    """One worker's restore and the parts around it, on device `device` of the test node."""

    def __init__(self, tmp_path: Path, device: int = 0, position: WorkerPosition | None = None) -> None:
        self.stream = io.StringIO()
        self.events = EventWriter(CONFIG, self.stream)
        self.board = MemoryBoard()
        self.position = position or WorkerPosition(rank=0)
        self.rendezvous = Rendezvous(
            self.board, key(device), self.position, self.events, StopRequest(), SETTINGS, "cpu"
        )
        torch.manual_seed(device)
        self.model = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.trainer = StateTrainer()
        self.path = checkpoint_path(str(tmp_path))
        self.resizes = ResizeMeter(self.events, TOTAL_STEPS)
        self.saver = CheckpointSaver(
            self.path,
            SPEC,
            self.model,
            self.optimizer,
            self.trainer,  # type: ignore[arg-type]
            self.events,
        )
        self.restore = StateRestore(
            self.rendezvous,
            self.position,
            self.events,
            self.model,
            self.optimizer,
            self.trainer,  # type: ignore[arg-type]
            None,
            self.path,
            SPEC,
            SETTINGS,
            self.resizes,
            self.saver,
        )

    def train_a_step(self) -> None:
        self.model(torch.ones(1, 4)).sum().backward()
        self.optimizer.step()

    def emitted(self, kind: str) -> list[WorkerEvent]:
        key_ = {"job_id": CONFIG.job_id, "generation": CONFIG.generation, "rank": CONFIG.rank}
        events = [decode(key_, line) for line in self.stream.getvalue().splitlines()]
        return [event for event in events if event.kind == kind]

    def close(self) -> None:
        self.rendezvous.leave_group()


def _alone(generation: int, has_state: bool = False) -> Membership:
    """A generation of device 0 alone, its store on a free port."""
    return record(generation, [0], joiners=[] if has_state else [0], has_state=has_state).model_copy(
        update={"master_port": free_port()}
    )


def test_a_group_of_one_with_no_checkpoint_starts_fresh(tmp_path: Path) -> None:
    worker = Worker(tmp_path)
    first = _alone(1)
    try:
        worker.restore.enter(first)
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert worker.position.membership == first
        assert (worker.position.rank, worker.position.step, worker.position.holds_state) == (0, 0, True)
        assert worker.position.group == [key(0)]
        assert worker.trainer.rebound == [(0, 1, None, 0)]
        assert worker.trainer.arrivals == 0
        assert len(worker.emitted("joined")) == 1
        assert [e.message for e in worker.emitted("log")] == ["starting from step 0 of 10, world size 1"]
        assert worker.rendezvous.pending == 0  # rank 0 watches the board
    finally:
        worker.close()
    assert not dist.is_initialized()


def test_a_group_of_one_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    before = Worker(tmp_path, device=1)
    before.train_a_step()
    before.trainer.small = {"position": 32}
    before.trainer.context += 7
    before.saver.save(step=4)
    saved = load_checkpoint(before.path)
    assert saved is not None

    worker = Worker(tmp_path)
    assert not torch.equal(worker.model.weight, before.model.weight)
    try:
        worker.restore.enter(_alone(5))
        assert worker.position.step == 4
        assert torch.equal(worker.model.weight, before.model.weight)
        assert (
            worker.optimizer.state_dict()["state"][0]["step"]
            == before.optimizer.state_dict()["state"][0]["step"]
        )
        assert worker.trainer.small == {"position": 32}
        assert torch.equal(worker.trainer.context, torch.full((3,), 7.0))
        assert worker.trainer.arrivals == 1
        assert worker.trainer.rebound == [(0, 1, None, 4)]
        [log] = [e.message or "" for e in worker.emitted("log")]
        assert log.startswith("resumed from the periodic checkpoint at step 4 of 10, world size 1")
    finally:
        worker.close()


def test_a_checkpoint_of_another_job_is_refused(tmp_path: Path) -> None:
    other = Worker(tmp_path)
    other.saver.spec = SPEC.model_copy(update={"seed": 99})
    other.saver.save(step=2)
    worker = Worker(tmp_path)
    try:
        with pytest.raises(CheckpointError, match="seed 99"):
            worker.restore.enter(_alone(1))
    finally:
        worker.close()


def test_a_generation_with_the_same_members_is_only_relabelled(tmp_path: Path) -> None:
    position = WorkerPosition(rank=0, step=6, holds_state=True, membership=_alone(2, has_state=True))
    position.group = [key(0)]
    position.last_step_end = 123.0
    worker = Worker(tmp_path, position=position)
    worker.resizes.switch_started = 1.0
    third = _alone(3, has_state=True)
    try:
        worker.restore.enter(third)
        assert not dist.is_initialized()  # no group was formed
        assert (worker.position.membership, worker.position.step) == (third, 6)
        assert worker.resizes.switch_started is None
        pending = worker.resizes.pending
        assert pending is not None
        assert (pending.generation, pending.bytes_moved, pending.last_step_end) == (3, 0, 123.0)
        assert [e.message for e in worker.emitted("log")] == [
            "generation 3: 1 -> 1 workers at step 6 of 10, world size 1; nothing to move"
        ]
    finally:
        worker.close()


def test_a_receiver_takes_on_the_outline_before_the_bulk_arrives(tmp_path: Path) -> None:
    holder = Worker(tmp_path, position=WorkerPosition(rank=0, step=9, holds_state=True))
    holder.train_a_step()
    holder.trainer.small = {"position": 72}
    outline = holder.restore.outline()
    assert isinstance(outline, StateOutline) and outline.step == 9

    joiner = Worker(tmp_path, device=1, position=WorkerPosition(rank=1))
    joiner.restore.receive_outline(outline)
    assert joiner.position.step == 9
    assert joiner.trainer.small == {"position": 72}
    state = joiner.optimizer.state_dict()["state"]
    assert state[0]["exp_avg"].shape == holder.model.weight.shape


def test_the_sources_are_the_holders_of_the_newest_state() -> None:
    def info(holds_state: bool, step: int) -> GroupInfo:
        return GroupInfo(holds_state=holds_state, step=step, group=[], last_step_end=None, outline=None)

    assert newest_holders([info(True, 5), info(False, 0), info(True, 5)]) == [0, 2]
    assert newest_holders([info(True, 4), info(True, 5), info(False, 9)]) == [1]
    assert newest_holders([info(False, 0), info(False, 0)]) == []


def test_a_new_rank_0_counts_to_its_first_save_from_now(tmp_path: Path) -> None:
    worker = Worker(tmp_path, position=WorkerPosition(rank=1, step=3, holds_state=True))
    worker.saver.last_save = 0.0
    try:
        worker.restore.adopt(_alone(2, has_state=True), 0)
        assert worker.saver.last_save > 0.0
        assert worker.position.is_leader
        [joined] = worker.emitted("joined")
        assert (joined.generation, joined.rank) == (2, 0)
        worker.saver.last_save = 0.0
        worker.restore.adopt(_alone(3, has_state=True), 0)
        assert worker.saver.last_save == 0.0  # it was rank 0 already
    finally:
        worker.close()


def test_the_state_is_relayed_down_chains_only_across_nodes() -> None:
    """Auto relays when the group spans several nodes (a chain crosses the sources' links once
    per chunk), and sends to each joiner on one node; a setting of relay or direct holds."""
    one_node = record(4, [0, 1, 2, 3], joiners=[2, 3])
    elsewhere = Member(node="node-b", device_index=0, address="10.0.0.2", joiner=True)
    two_nodes = one_node.model_copy(update={"members": [*one_node.members[:3], elsewhere]})
    donor_away = record(5, [0, 1], joiners=[1]).model_copy(
        update={"donor": elsewhere.model_copy(update={"joiner": False})}
    )
    assert not relayed("auto", one_node)
    assert relayed("auto", two_nodes)
    assert relayed("auto", donor_away)
    assert relayed("relay", one_node) and not relayed("direct", two_nodes)
