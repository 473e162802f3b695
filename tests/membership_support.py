"""A job's membership board in memory (elastic.membership.Board), for tests that drive the
worker's rendezvous without Redis or processes, helpers to write membership records, and a
program that squats a generation's port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from elastic.membership.api import Board
from elastic.wire import Member, Membership, member_key

NODE = "node-t"


def key(device: int) -> str:
    """The member key of device `device` of NODE."""
    return member_key(NODE, device)


def record(
    generation: int,
    devices: Sequence[int],
    joiners: Sequence[int] = (),
    has_state: bool = True,
    donor: int | None = None,
) -> Membership:
    """Generation `generation` on NODE's `devices` (rank order); those in `joiners` join."""
    return Membership(
        job_id=1,
        generation=generation,
        master_addr="127.0.0.1",
        master_port=29500 + generation,
        members=[
            Member(node=NODE, device_index=device, address="127.0.0.1", joiner=device in joiners)
            for device in devices
        ],
        has_state=has_state,
        donor=None
        if donor is None
        else Member(node=NODE, device_index=donor, address="127.0.0.1", joiner=False),
    )


class MemoryBoard(Board):
    """The Board contract kept in this process's memory; thread-safe."""

    def __init__(self) -> None:
        self._records: dict[int, Membership] = {}
        self._latest = 0
        self._ready: dict[int, set[str]] = {}
        self._tokens: dict[tuple[str, int], list[int]] = {}
        self._changed = threading.Condition()
        self.closed = False

    def publish(self, record: Membership) -> bool:
        with self._changed:
            self._records[record.generation] = record
            advanced = record.generation > self._latest
            self._latest = max(self._latest, record.generation)
            self._changed.notify_all()
            return advanced

    def latest_generation(self) -> int:
        with self._changed:
            return self._latest

    def record(self, generation: int) -> Membership | None:
        with self._changed:
            return self._records.get(generation)

    def mark_ready(self, generation: int, member: str) -> None:
        with self._changed:
            self._ready.setdefault(generation, set()).add(member)

    def ready(self, generation: int) -> set[str]:
        with self._changed:
            return set(self._ready.get(generation, set()))

    def send_go(self, generation: int, tokens: int) -> None:
        self._push(("go", generation), tokens)

    def wait_go(self, generation: int, timeout_s: float) -> bool:
        return self._take(("go", generation), timeout_s) is not None

    def announce_store(self, generation: int, port: int, tokens: int) -> None:
        self._push(("store", generation), tokens, port)

    def wait_store(self, generation: int, timeout_s: float) -> int | None:
        return self._take(("store", generation), timeout_s)

    def _push(self, name: tuple[str, int], tokens: int, value: int = 0) -> None:
        with self._changed:
            self._tokens.setdefault(name, []).extend([value] * tokens)
            self._changed.notify_all()

    def _take(self, name: tuple[str, int], timeout_s: float) -> int | None:
        with self._changed:
            if not self._changed.wait_for(lambda: bool(self._tokens.get(name)), timeout=timeout_s):
                return None
            return self._tokens[name].pop(0)

    def close(self) -> None:
        self.closed = True


class SilentListener:
    """Another program on a port of 127.0.0.1 (`port`; 0: any free one): it accepts connections
    and never answers (RabbitMQ's 25672, which CI once drew as a generation's port, does so to
    anything that is not Erlang). Keeps the connections it accepted, in `accepted`."""

    def __init__(self, port: int = 0) -> None:
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                self.accepted.append(self.server.accept()[0])
            except TimeoutError:
                continue

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        for connection in self.accepted:
            connection.close()
        self.server.close()
