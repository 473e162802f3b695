"""The worker's rendezvous (elastic.worker.rendezvous) against an in-memory board, without
processes: a holder of the state waits for the joiners to be ready before it wakes them, and
goes on to a newer generation instead if one comes; a joiner marks itself ready and waits for the
go; a record that leaves the worker out makes it leave; a stop ends every wait; rank 0's watcher
sees the next generation once its joiners are ready."""

from __future__ import annotations

import io
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from elastic.membership.api import BoardUnavailable
from elastic.wire import Membership
from elastic.worker import LEFT_EXIT_CODE, STOPPED_EXIT_CODE, WorkerExit
from elastic.worker.event_codec import decode
from elastic.worker.events import EventWriter
from elastic.worker.local import free_port
from elastic.worker.position import WorkerPosition
from elastic.worker.rendezvous import (
    MembershipWatcher,
    Rendezvous,
    RendezvousError,
    backend_for,
    connect_store,
)
from elastic.worker.settings import WorkerSettings
from elastic.worker.stop import StopRequest
from tests.membership_support import MemoryBoard, SilentListener, key, record
from tests.test_worker_events import CONFIG

SETTINGS = WorkerSettings(membership_poll_s=0.001)


class ScriptedBoard(MemoryBoard):
    """A MemoryBoard that counts the calls of the methods a worker polls and runs an action
    (`when[(method, n)]`) on the n-th call, before answering it; it keeps every go it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.when: dict[tuple[str, int], Callable[[], object]] = {}
        self.sent: list[tuple[int, int]] = []

    def _called(self, method: str) -> None:
        self.calls.append(method)
        action = self.when.pop((method, self.calls.count(method)), None)
        if action is not None:
            action()

    def ready(self, generation: int) -> set[str]:
        self._called("ready")
        return super().ready(generation)

    def wait_go(self, generation: int, timeout_s: float) -> bool:
        self._called("wait_go")
        return super().wait_go(generation, timeout_s)

    def send_go(self, generation: int, tokens: int) -> None:
        self.sent.append((generation, tokens))
        super().send_go(generation, tokens)


def _rendezvous(
    board: MemoryBoard, device: int, holds_state: bool, rank: int = 0, stop: StopRequest | None = None
) -> tuple[Rendezvous, io.StringIO]:
    stream = io.StringIO()
    position = WorkerPosition(rank=rank, holds_state=holds_state, step=7 if holds_state else 0)
    events = EventWriter(CONFIG, stream)
    return Rendezvous(board, key(device), position, events, stop or StopRequest(), SETTINGS, "cpu"), stream


def _logs(stream: io.StringIO) -> list[str]:
    key_ = {"job_id": CONFIG.job_id, "generation": CONFIG.generation, "rank": CONFIG.rank}
    return [decode(key_, line).message or "" for line in stream.getvalue().splitlines()]


def _leaves(rendezvous: Rendezvous, newer_than: int, match: str | None = None) -> None:
    """Asserts that awaiting a generation newer than `newer_than` makes the worker leave the job:
    WorkerExit with LEFT_EXIT_CODE, its message matching `match` if given."""
    with pytest.raises(WorkerExit, match=match) as way_out:
        rendezvous.await_generation(newer_than=newer_than)
    assert way_out.value.code == LEFT_EXIT_CODE


# --- a holder of the state -------------------------------------------------------------------


def test_a_holder_waits_until_every_joiner_is_ready_then_wakes_them() -> None:
    board = ScriptedBoard()
    gen2 = record(2, [0, 1, 2], joiners=[1, 2])
    board.publish(gen2)
    board.mark_ready(2, key(1))

    def last_joiner_ready() -> None:
        assert board.sent == []  # nobody was woken before every joiner was ready
        board.mark_ready(2, key(2))

    board.when[("ready", 3)] = last_joiner_ready
    rendezvous, stream = _rendezvous(board, 0, holds_state=True)
    assert rendezvous.await_generation(newer_than=1) == gen2
    assert board.calls.count("ready") == 3
    assert board.sent == [(2, 2)]
    assert _logs(stream) == ["waiting for 2 joiner(s) of generation 2 to warm up"]


def test_only_the_lowest_ranked_holder_says_it_waits() -> None:
    board = ScriptedBoard()
    board.publish(record(2, [0, 1], joiners=[1]))
    board.when[("ready", 2)] = lambda: board.mark_ready(2, key(1))
    rendezvous, stream = _rendezvous(board, 0, holds_state=True, rank=1)
    assert rendezvous.await_generation(newer_than=1).generation == 2
    assert _logs(stream) == []


def test_a_holder_with_no_joiner_to_wait_for_forms_at_once() -> None:
    board = ScriptedBoard()
    board.publish(record(3, [1, 0]))
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    assert rendezvous.await_generation(newer_than=2).generation == 3
    assert board.calls.count("ready") == 1
    assert board.sent == [(3, 0)]


def test_a_holder_goes_on_to_a_newer_generation_while_the_joiners_are_not_ready() -> None:
    board = ScriptedBoard()
    board.publish(record(2, [0, 1], joiners=[1]))
    board.when[("ready", 2)] = lambda: board.publish(record(3, [0]))
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    assert rendezvous.await_generation(newer_than=1).generation == 3
    assert board.sent == [(3, 0)]  # the joiner of generation 2 was never woken


def test_waiting_for_the_joiners_ends_when_a_newer_generation_comes() -> None:
    board = ScriptedBoard()
    board.publish(record(2, [0, 1], joiners=[1]))
    board.when[("ready", 3)] = lambda: board.publish(record(3, [0]))
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    assert rendezvous.await_ready(2, {key(1)}) is False
    assert board.calls.count("ready") == 3


def test_a_holder_left_out_of_the_newest_record_leaves() -> None:
    board = MemoryBoard()
    board.publish(record(2, [1, 2], joiners=[2]))
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    _leaves(rendezvous, newer_than=1, match=r"generation 2 does not name node-t/0")


@pytest.mark.timeout(30)  # without the rule it waits for itself for ever
def test_a_holder_named_as_a_joiner_leaves_for_the_new_worker() -> None:
    """A worker cut off with its node holds the state of its last step; the portal took it for
    gone and, once the node was back, planned a new worker on its device. If that record is the
    first this worker reads, it leaves (the agent starts the new one): waiting as a holder for
    itself to warm up held the whole job until the generation expired."""
    board = ScriptedBoard()
    board.publish(record(4, [1, 0], joiners=[0]))
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    _leaves(rendezvous, newer_than=2, match=r"generation 4 takes node-t/0 as a new worker.*state of step 7")
    assert board.sent == [] and board.ready(4) == set()


def test_the_donor_of_a_generation_is_named_by_it() -> None:
    board = MemoryBoard()
    with_donor = record(2, [1], joiners=[1], donor=0)
    board.publish(with_donor)
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    board.mark_ready(2, key(1))
    assert rendezvous.await_generation(newer_than=1) == with_donor


# --- a joiner --------------------------------------------------------------------------------


def test_a_joiner_marks_itself_ready_and_waits_for_the_go() -> None:
    board = ScriptedBoard()
    gen2 = record(2, [0, 1], joiners=[1])
    board.publish(gen2)

    def go() -> None:
        assert board.ready(2) == {key(1)}
        board.send_go(2, 1)

    board.when[("wait_go", 2)] = go
    rendezvous, _ = _rendezvous(board, 1, holds_state=False)
    assert rendezvous.await_generation(newer_than=1) == gen2
    assert board.calls.count("wait_go") == 2


def test_a_joiner_with_no_holder_to_wait_for_forms_at_once() -> None:
    board = ScriptedBoard()
    first = record(1, [0, 1], joiners=[0, 1], has_state=False)
    board.publish(first)
    rendezvous, _ = _rendezvous(board, 1, holds_state=False)
    assert rendezvous.await_generation(newer_than=0) == first
    assert board.ready(1) == {key(1)}
    assert "wait_go" not in board.calls


def test_a_joiner_starts_over_when_a_newer_generation_comes() -> None:
    board = ScriptedBoard()
    board.publish(record(2, [0, 1], joiners=[1]))
    board.when[("wait_go", 1)] = lambda: board.publish(record(3, [0, 1, 2], joiners=[1, 2]))
    board.when[("wait_go", 2)] = lambda: board.send_go(3, 1)
    rendezvous, _ = _rendezvous(board, 1, holds_state=False)
    assert rendezvous.await_generation(newer_than=1).generation == 3
    assert board.ready(2) == {key(1)}
    assert board.ready(3) == {key(1)}


def test_a_joiner_left_out_of_the_newest_record_leaves() -> None:
    board = MemoryBoard()
    board.publish(record(2, [0]))
    rendezvous, _ = _rendezvous(board, 1, holds_state=False)
    _leaves(rendezvous, newer_than=1)
    assert board.ready(2) == set()


@pytest.mark.parametrize(
    ("holds_state", "where"), [(False, "stopped before training"), (True, "stopped between generations")]
)
def test_a_stop_ends_the_wait(holds_state: bool, where: str) -> None:
    stop = StopRequest()
    stop.signal_number = signal.SIGTERM
    rendezvous, _ = _rendezvous(MemoryBoard(), 0, holds_state=holds_state, stop=stop)
    with pytest.raises(WorkerExit, match=where) as way_out:
        rendezvous.await_generation(newer_than=0)
    assert way_out.value.code == STOPPED_EXIT_CODE


# --- the switch ------------------------------------------------------------------------------


def _in_group(rendezvous: Rendezvous, generation: Membership) -> None:
    rendezvous.position.membership = generation
    rendezvous.position.group = generation.keys()


def test_at_a_switch_rank_0_wakes_the_joiners() -> None:
    board = ScriptedBoard()
    gen3 = record(3, [0, 1, 2], joiners=[2])
    board.publish(gen3)
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    _in_group(rendezvous, record(2, [0, 1]))
    assert rendezvous.switch(3) == gen3
    assert board.sent == [(3, 1)]
    other, _ = _rendezvous(board, 1, holds_state=True, rank=1)
    _in_group(other, record(2, [0, 1]))
    assert other.switch(3) == gen3
    assert board.sent == [(3, 1)]


def test_at_a_switch_a_leaver_leaves() -> None:
    board = MemoryBoard()
    board.publish(record(3, [0]))
    rendezvous, _ = _rendezvous(board, 1, holds_state=True, rank=1)
    _in_group(rendezvous, record(2, [0, 1]))
    with pytest.raises(
        WorkerExit, match="left the job at step 7: generation 3 does not name node-t/1"
    ) as way_out:
        rendezvous.switch(3)
    assert way_out.value.code == LEFT_EXIT_CODE
    assert rendezvous.position.membership is None


def test_a_switch_to_a_record_that_is_gone_fails() -> None:
    rendezvous, _ = _rendezvous(MemoryBoard(), 0, holds_state=True)
    with pytest.raises(RuntimeError, match="generation 4 was agreed but its record is gone"):
        rendezvous.switch(4)


# --- rank 0's watcher ------------------------------------------------------------------------


def test_the_watcher_asks_for_the_next_generation_once_its_joiners_are_ready() -> None:
    board = MemoryBoard()
    board.publish(record(2, [0, 1]))
    watcher = MembershipWatcher(
        board, 2, [key(0), key(1)], every_s=3600, events=EventWriter(CONFIG, io.StringIO())
    )
    try:
        watcher.check()
        assert watcher.pending == 0
        board.publish(record(3, [1, 2, 0], joiners=[2]))
        watcher.check()
        assert watcher.pending == 0
        board.mark_ready(3, key(2))
        watcher.check()
        assert watcher.pending == 3
        board.publish(record(4, [0]))  # a shrink has no joiner to wait for
        watcher.check()
        assert watcher.pending == 4
    finally:
        watcher.stop()


class _UnavailableBoard(MemoryBoard):
    def __init__(self, failures_seen: threading.Event) -> None:
        super().__init__()
        self.failures = 0
        self._failures_seen = failures_seen

    def latest_generation(self) -> int:
        self.failures += 1
        if self.failures == 3:
            self._failures_seen.set()
        raise BoardUnavailable("the board is away")


def test_the_watcher_trains_on_while_the_board_is_away_and_says_so_once() -> None:
    failures_seen = threading.Event()
    stream = io.StringIO()
    watcher = MembershipWatcher(
        _UnavailableBoard(failures_seen), 2, [key(0)], every_s=0.001, events=EventWriter(CONFIG, stream)
    )
    try:
        assert failures_seen.wait(timeout=30)
    finally:
        watcher.stop()
    assert watcher.pending == 0
    assert _logs(stream) == ["cannot read the membership board, training on: the board is away"]


# --- the process group -----------------------------------------------------------------------


def test_a_stop_ends_a_joiners_wait_for_rank_0s_store() -> None:
    """Rank 0 stopped first (a cancel stops every worker at once): a joiner, which holds nothing,
    stops instead of waiting the formation's whole timeout for a store that never listens; a
    holder of the state waits on, to form the group that saves it."""
    stop = StopRequest()
    stop.signal_number = signal.SIGTERM
    nobody = {**record(2, [0, 1], joiners=[1]).model_dump(), "master_port": free_port()}
    joiner, _ = _rendezvous(MemoryBoard(), 1, holds_state=False, rank=1, stop=stop)
    with pytest.raises(WorkerExit, match="stopped before training") as way_out:
        joiner.form(Membership(**nobody), 1, 2, "switch", timeout_s=60)
    assert way_out.value.code == STOPPED_EXIT_CODE
    holder, _ = _rendezvous(MemoryBoard(), 1, holds_state=True, rank=1, stop=stop)
    with pytest.raises(RendezvousError, match="rank 0 of generation 2 did not say its store listens within 0.2 s"):
        holder.form(Membership(**nobody), 1, 2, "switch", timeout_s=0.2)


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda:0", "nccl"), ("cuda:12", "nccl")])
def test_the_backend_follows_the_device(device: str, backend: str) -> None:
    assert backend_for(device) == backend


def test_workers_sharing_a_gpu_use_gloo() -> None:
    assert backend_for("cuda:0", shared_gpu=True) == "gloo"
    assert backend_for("cpu", shared_gpu=True) == "gloo"


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x", "mps"])
def test_an_unknown_device_is_refused(device: str) -> None:
    with pytest.raises(ValueError, match=repr(device)):
        backend_for(device)


# --- forming the group -----------------------------------------------------------------------


def test_a_failed_formation_leaves_the_next_groups_name_as_every_member_has_it() -> None:
    """torch names the default group after a per-process counter that a failed formation leaves
    advanced: a member whose counter differed from its peers' would wait on other rendezvous
    keys for good (generation after generation expired in bench/soak.py). Every group this
    worker forms is named as a fresh process names it."""
    import torch.distributed as dist

    board = MemoryBoard()
    rendezvous, _ = _rendezvous(board, 0, holds_state=True)
    nobody_comes = record(5, [0, 1]).model_copy(update={"master_port": free_port()})
    with pytest.raises(RendezvousError):
        rendezvous.form(nobody_comes, 0, 2, "switch", timeout_s=0.5)
    assert board.wait_store(5, 0.01) == nobody_comes.master_port, "rank 0 did not say where its store listened"
    alone = record(6, [0]).model_copy(update={"master_port": free_port()})
    rendezvous.form(alone, 0, 1, "switch", timeout_s=10)
    try:
        assert dist.distributed_c10d._get_default_group().group_name == "0"
    finally:
        rendezvous.leave_group()


def test_a_port_where_another_program_listens_costs_rank_0_nothing() -> None:
    """CI once drew RabbitMQ's 25672 as a generation's port. Rank 0 makes its store at a port the
    kernel picks instead, says so in its log, and tells the members that port."""
    squatter = SilentListener()
    board = MemoryBoard()
    try:
        squatted = record(2, [0, 1]).model_copy(update={"master_port": squatter.port})
        rank_0, log = _rendezvous(board, 0, holds_state=True, rank=0)
        with pytest.raises(RendezvousError, match="[Ww]ait timeout"):  # nobody else comes
            rank_0.form(squatted, 0, 2, "switch", timeout_s=0.5)
        port = board.wait_store(2, 0.01)
        assert port is not None and port != squatter.port
        said = f"generation 2: port {squatter.port} is taken by another program; the store listens at {port} instead"
        assert said in _logs(log)
        assert squatter.accepted == []
    finally:
        squatter.close()


def test_members_wait_for_rank_0s_word_and_go_on_when_a_newer_generation_comes() -> None:
    """Nobody connects to the record's port on its own: what listens there may be another
    program, and torch's store client hung there past the next generation's deadline. Members
    wait for rank 0's word, and give up on the generation as soon as a newer one is published."""
    squatter = SilentListener()
    board = MemoryBoard()
    try:
        squatted = record(2, [0, 1, 2], joiners=[2]).model_copy(update={"master_port": squatter.port})
        board.publish(squatted)
        failures: list[BaseException] = []

        def member(device: int, holds_state: bool) -> None:
            rendezvous, _ = _rendezvous(board, device, holds_state=holds_state, rank=device)
            try:
                rendezvous.form(squatted, device, 3, "switch", timeout_s=30)
            except RendezvousError as err:
                failures.append(err)

        members = [threading.Thread(target=member, args=(1, True)), threading.Thread(target=member, args=(2, False))]
        for thread in members:
            thread.start()
        time.sleep(0.3)  # both wait for rank 0's word
        assert all(thread.is_alive() for thread in members)
        board.publish(record(3, [0, 1, 2], joiners=[2]))
        for thread in members:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in members), "a member waited on after generation 3 came"
        assert [str(err) for err in failures] == [
            "generation 2 was replaced by a newer one before its rank 0 said its store listens"
        ] * 2
        assert squatter.accepted == []
    finally:
        squatter.close()


def test_a_store_client_that_gets_no_answer_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline of the last wait: torch's store client, against a program that accepts and
    never answers, waited past its own timeout (over 40 s with timeout=3 s)."""
    import elastic.worker.rendezvous as rendezvous

    monkeypatch.setattr(rendezvous, "STORE_CONNECT_S", 0.5)
    squatter = SilentListener()
    try:
        with pytest.raises(RendezvousError, match="does not answer as rank 0's store"):
            connect_store("127.0.0.1", squatter.port, 2, timedelta(seconds=30))
        # It gave up on its own deadline: torch's attempt, which waits for its 30 s timeout, is
        # still under way in its thread.
        assert any(
            thread.name == f"store-client-{squatter.port}" and thread.is_alive() for thread in threading.enumerate()
        ), "it waited for the store's own timeout"
    finally:
        squatter.close()
