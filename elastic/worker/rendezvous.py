"""Meeting the other members of a generation: waiting on the job's board (an
elastic.membership.Board) until a generation that names this worker can be formed, forming its
process group, and, while the group trains, rank 0's watch for the next generation. The board's
keys and protocol are in elastic.membership.redis; what the members tell each other once the
group is formed, and the training state that follows, in elastic.worker.restore.

Every wait here ends: on a stop, on a newer generation, or at a timeout (RendezvousError); a
board that does not answer raises BoardUnavailable after its client's retries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

from elastic.membership.api import Board, BoardUnavailable
from elastic.wire import Membership
from elastic.worker import LEFT_EXIT_CODE, STOPPED_EXIT_CODE, WorkerExit
from elastic.worker.events import EventWriter
from elastic.worker.position import WorkerPosition
from elastic.worker.settings import WorkerSettings
from elastic.worker.stop import StopRequest
from elastic.worker.transfer import StateOutline

GO_WAIT_S = 0.25
"""A member waiting for the go or for rank 0's store looks at the board's latest generation
this often (the token itself wakes it at once)."""


def backend_for(device: str, shared_gpu: bool = False) -> str:
    """Return the torch.distributed backend for a WorkerConfig device: gloo for "cpu", nccl
    for "cuda:N", gloo for "cuda:N" when the job's workers share a GPU (NCCL refuses that).
    Raises ValueError for anything else."""
    if device == "cpu":
        return "gloo"
    if device.startswith("cuda:") and device.removeprefix("cuda:").isdigit():
        return "gloo" if shared_gpu else "nccl"
    raise ValueError(f'device {device!r} is neither "cpu" nor "cuda:N"')


class RendezvousError(RuntimeError):
    """A generation's group could not be formed, or its state not restored: a member is gone."""


STORE_CONNECT_S = 10.0
"""The longest a member waits for its client of rank 0's store to be made. It connects only
once rank 0 said its store listens (Board.announce_store), and then that takes milliseconds.
The deadline is for what should never happen: against a program that accepts connections and
never answers, torch's TCPStore client waits past its own timeout (over 40 s with
timeout=3 s, seen here)."""


def connect_store(host: str, port: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the TCPStore at host:port (`timeout`: its operations' timeout). Raises
    RendezvousError if it cannot be made within STORE_CONNECT_S: what answers there is not
    rank 0's store. The attempt then goes on in a daemon thread of its own (torch's call cannot
    be interrupted; it releases the GIL), which ends with its connection or with the process."""
    made: list[dist.TCPStore | BaseException] = []

    def make() -> None:
        try:
            made.append(dist.TCPStore(host, port, world, False, timeout=timeout, wait_for_workers=False))
        except BaseException as err:  # handed to the caller
            made.append(err)

    attempt = threading.Thread(target=make, name=f"store-client-{port}", daemon=True)
    attempt.start()
    attempt.join(STORE_CONNECT_S)
    if not made:
        raise RendezvousError(
            f"{host}:{port} accepts connections but does not answer as rank 0's store within "
            f"{STORE_CONNECT_S:.0f} s (another program listens there?)"
        )
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def serve_store(host: str, port: int, world: int, timeout: timedelta) -> tuple[dist.TCPStore, str]:
    """Rank 0's TCPStore (it listens on every address; `host` is its own client's way to it),
    at `port` or, if another program holds that port (EADDRINUSE), at one the kernel picks: a
    taken port costs the generation nothing, since the members learn the port from
    Board.announce_store, never from the record. Returns the store and a line for the log when
    the port was taken, else ""."""
    try:
        return dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=False), ""
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
    store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False)
    return store, f"port {port} is taken by another program; the store listens at {store.port} instead"


class MembershipWatcher:
    """Rank 0's view of the board, from a thread of its own so that the training loop never
    waits on the board: `pending` becomes the newest generation once every member of it outside
    the running group (`group`) said it is ready; 0 until then."""

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
                self.check()
                failures = 0
            except BoardUnavailable as err:
                failures += 1
                if failures == 1:
                    self._events.log(f"cannot read the membership board, training on: {err}")

    def check(self) -> None:
        """Looks at the board once (the thread does so every `every_s`)."""
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
class GroupInfo:
    """What each member tells the others when a group forms."""

    holds_state: bool
    step: int
    group: list[str]
    """The member keys of the group it comes from (empty for a joiner)."""
    last_step_end: float | None
    """Wall-clock end of its last step in that group."""
    outline: StateOutline | None


class Rendezvous:
    """One worker's side of the meeting: `me` is its member key, `position` where it stands
    (this class sets its `membership` to None when it leaves a group; the rest it only reads).
    `device` is the WorkerConfig's ("cpu" or "cuda:N"). Raises ValueError for another device."""

    def __init__(
        self,
        board: Board,
        me: str,
        position: WorkerPosition,
        events: EventWriter,
        stop: StopRequest,
        settings: WorkerSettings,
        device: str,
    ) -> None:
        self.board = board
        self.me = me
        self.position = position
        self.events = events
        self.stop = stop
        self.settings = settings
        self.backend = backend_for(device, settings.shared_gpu)
        self.device = torch.device(device)
        self._store: dist.TCPStore | None = None
        self._watcher: MembershipWatcher | None = None

    def names_me(self, record: Membership) -> bool:
        """Whether `record` has a place for this worker: as a member, or as the donor that hands
        the state over and goes."""
        is_donor = record.donor is not None and record.donor.key == self.me
        return record.rank_of(self.me) is not None or is_donor

    # --- between groups ----------------------------------------------------------------------

    def await_generation(self, newer_than: int) -> Membership:
        """Returns the first record newer than `newer_than` that names this worker, once it can
        be formed: for a holder of the state, once every joiner is ready (it wakes them); for a
        joiner, after the go (at once when no member holds the state). Raises WorkerExit if a
        record leaves this worker out, names this holder of the state as a joiner (a new worker
        in its place), or a stop is asked."""
        while True:
            record = self.board.latest()
            if record is None or record.generation <= newer_than:
                self._sleep(self.settings.membership_poll_s)
                continue
            if not self.names_me(record):
                raise WorkerExit(
                    LEFT_EXIT_CODE, f"left the job: generation {record.generation} does not name {self.me}"
                )
            joiners = {member.key for member in record.members if member.joiner}
            if self.position.holds_state and self.me in joiners:
                # The portal took this worker for gone (its node was cut off, say) and planned a
                # new one on its device; the agent lets that one start once this one is out of
                # the way. Staying would deadlock: the holders wait for the joiner to say it is
                # ready, and this worker, a holder itself, would wait with them.
                raise WorkerExit(
                    LEFT_EXIT_CODE,
                    f"left the job: generation {record.generation} takes {self.me} as a new worker, and this "
                    f"one holds the state of step {self.position.step} from before; the new one takes its place",
                )
            if self.position.holds_state:
                if not self.await_ready(record.generation, joiners):
                    newer_than = record.generation
                    continue
                self.board.send_go(record.generation, len(joiners))
                return record
            self.board.mark_ready(record.generation, self.me)
            if not record.has_state:
                return record
            while True:
                self.check_stop()
                if self.board.wait_go(record.generation, GO_WAIT_S):
                    return record
                if self.board.latest_generation() > record.generation:
                    newer_than = record.generation
                    break

    def await_ready(self, generation: int, joiners: set[str]) -> bool:
        """A holder of the state waits until every joiner of `generation` said it is ready
        (a joiner may still be importing torch), so that the group it forms next does not
        time out on a member that is merely slow. Returns False as soon as a newer generation
        is published instead: the portal expires a generation whose joiners are not ready by
        its deadline (elastic.membership.GenerationPhase) and plans one without them. Raises
        WorkerExit if a stop is asked."""
        announced = False
        while not joiners <= self.board.ready(generation):
            if self.board.latest_generation() > generation:
                return False
            if not announced:
                if self.position.rank == 0:  # the lowest-ranked holder speaks for them all
                    self.events.log(
                        f"waiting for {len(joiners)} joiner(s) of generation {generation} to warm up"
                    )
                announced = True
            self._sleep(self.settings.membership_poll_s)
        return True

    def switch(self, generation: int) -> Membership:
        """After the step at which the group agreed to switch to `generation`: returns its
        record, rank 0 having woken its joiners. Raises WorkerExit for a leaver (it leaves the
        group first), RuntimeError if the record is gone."""
        self.stop_watching()
        record = self.board.record(generation)
        if record is None:
            raise RuntimeError(f"generation {generation} was agreed but its record is gone")
        if self.position.rank == 0:
            joiners = [key for key in record.keys() if key not in self.position.group]
            self.board.send_go(generation, len(joiners))
        if not self.names_me(record):
            self.leave_group()
            raise WorkerExit(
                LEFT_EXIT_CODE,
                f"left the job at step {self.position.step}: generation {generation} does not name {self.me}",
            )
        return record

    def check_stop(self) -> None:
        """Raises WorkerExit (STOPPED_EXIT_CODE) if a stop was asked."""
        if self.stop.requested:
            where = "between generations" if self.position.holds_state else "before training"
            raise WorkerExit(STOPPED_EXIT_CODE, f"stopped {where}")

    def _sleep(self, seconds: float) -> None:
        self.check_stop()
        time.sleep(seconds)

    # --- the process group -------------------------------------------------------------------

    def form(self, record: Membership, rank: int, world: int, phase: str, timeout_s: float) -> None:
        """Joins generation `record`'s process group as `rank` of `world`; the store is rank 0's,
        at the record's master address and port (a new one for the "switch" phase, the same one
        for a later phase of the generation). Raises RendezvousError after `timeout_s`."""
        timeout = timedelta(seconds=timeout_s)
        try:
            if phase == "switch" or self._store is None:
                if rank != 0:
                    # A worker with no state to save stops at once when asked (rank 0 may have
                    # stopped already); a holder forms the group, which saves at its first step.
                    check = (lambda: None) if self.position.holds_state else self.check_stop
                    port = self.await_store(record.generation, timeout_s, check)
                    self._store = connect_store(record.master_addr, port, world, timeout)
                else:
                    self._store, taken = serve_store(record.master_addr, record.master_port, world, timeout)
                    if taken:
                        self.events.log(f"generation {record.generation}: {taken}")
                    self.board.announce_store(record.generation, self._store.port, world - 1)
            # torch names the default group after a per-process counter that only the group's
            # destruction resets; a failed init_process_group leaves it advanced, and a member
            # whose counter differs from the others' waits on other rendezvous keys, so that
            # its generations never form again (bench/soak.py found it). Every member starts
            # each group from the same name.
            _world.group_count = 0
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"g{record.generation}/{phase}", self._store),
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=self.device if self.backend == "nccl" else None,
            )
            # Forming waits `timeout_s` for the members; a step waits the group's own timeout.
            _set_pg_timeout(timedelta(seconds=self.settings.pg_timeout_s))
        except RendezvousError:
            raise
        except (RuntimeError, ValueError) as err:  # DistStoreError, DistNetworkError included
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RendezvousError(str(err)) from err

    def await_store(self, generation: int, timeout_s: float, check: Callable[[], None]) -> int:
        """The port rank 0 of `generation` said its store listens at, once it said so. Calls
        `check` between looks (it raises to give up: a stop asked). Raises RendezvousError as
        soon as a newer generation is published (this one will never form), or after
        `timeout_s`. Until then nothing connects anywhere: what listens at the record's port may
        be another program."""
        deadline = time.monotonic() + timeout_s
        while True:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank 0 of generation {generation} did not say its store listens within {timeout_s:g} s"
                )
            # Never 0: a BLPOP of timeout 0 (or a few µs, rounded down to 0 ms) waits for good.
            port = self.board.wait_store(generation, min(GO_WAIT_S, max(left, 0.01)))
            if port is not None:
                return port
            if self.board.latest_generation() > generation:
                raise RendezvousError(
                    f"generation {generation} was replaced by a newer one before its rank 0 said its store listens"
                )

    def exchange(self, mine: GroupInfo) -> list[GroupInfo]:
        """Returns what every member of the group just formed told the others, by rank; `mine`
        is this worker's. Raises RendezvousError if a member is gone."""
        infos: list[GroupInfo] = [mine] * dist.get_world_size()
        try:
            dist.all_gather_object(infos, mine)
        except RuntimeError as err:
            raise RendezvousError(f"the members could not exchange their state: {err}") from err
        return infos

    def leave_group(self) -> None:
        """Leaves the current process group, if any; the training state stays."""
        self.stop_watching()
        self.position.membership = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                self.events.log(f"could not tear down the old process group cleanly: {err}")

    # --- watching for the next generation ----------------------------------------------------

    def watch(self, record: Membership, rank: int) -> None:
        """Rank 0 of `record`'s group starts watching the board for the next generation; any
        other rank stops watching."""
        self.stop_watching()
        if rank == 0:
            self._watcher = MembershipWatcher(
                self.board, record.generation, record.keys(), self.settings.membership_poll_s, self.events
            )

    @property
    def pending(self) -> int:
        """The generation rank 0 asks the group to switch to, once its joiners are ready; 0 if
        none (or this rank does not watch)."""
        return self._watcher.pending if self._watcher is not None else 0

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
