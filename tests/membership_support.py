"""A job's membership board in memory (elastic.membership.Board), for tests that drive the
worker's rendezvous without Redis or processes, and helpers to write membership records."""

from __future__ import annotations

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
        self._go: dict[int, int] = {}
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
        if tokens < 1:
            return
        with self._changed:
            self._go[generation] = self._go.get(generation, 0) + tokens
            self._changed.notify_all()

    def wait_go(self, generation: int, timeout_s: float) -> bool:
        with self._changed:
            if not self._changed.wait_for(lambda: self._go.get(generation, 0) > 0, timeout=timeout_s):
                return False
            self._go[generation] -= 1
            return True

    def close(self) -> None:
        self.closed = True
