"""A bounded, ordered buffer of worker events.

Events wait here between the worker that emitted them and a report the portal accepted. When
the portal is away for long, or a worker floods its stdout, the buffer fills; it then drops
the oldest log line first, then the oldest progress event, and a lifecycle event (started,
joined, resized, exited) only when it holds nothing else, since the portal rebuilds a job's state from those.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

from elastic.wire import WorkerEvent

_LOG, _PROGRESS, _LIFECYCLE = 0, 1, 2
_CLASS = {
    "log": _LOG,
    "progress": _PROGRESS,
    "step_times": _PROGRESS,
    "evaluation": _PROGRESS,
    "started": _LIFECYCLE,
    "joined": _LIFECYCLE,
    "resized": _LIFECYCLE,
    "exited": _LIFECYCLE,
    "form_failed": _LIFECYCLE,
    "artifacts": _LIFECYCLE,
    "environment": _LIFECYCLE,
}


class EventBuffer:
    """Holds at most `capacity` events in arrival order. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an event buffer needs a capacity of at least 1, got {capacity}")
        self._capacity = capacity
        self._queues: tuple[deque[tuple[int, WorkerEvent]], ...] = (deque(), deque(), deque())
        self._seq = itertools.count()
        self._dropped = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(queue) for queue in self._queues)

    @property
    def dropped(self) -> int:
        """How many events were dropped for lack of room since the buffer was made."""
        return self._dropped

    def add(self, event: WorkerEvent) -> None:
        with self._lock:
            self._queues[_CLASS[event.kind]].append((next(self._seq), event))
            self._trim()

    def extend(self, events: list[WorkerEvent]) -> None:
        for event in events:
            self.add(event)

    def peek(self, limit: int | None = None) -> list[WorkerEvent]:
        """Returns the oldest `limit` events (all if None) in order, leaving them in place."""
        with self._lock:
            merged = sorted(itertools.chain(*self._queues), key=lambda item: item[0])
        return [event for _, event in merged[:limit]]

    def remove(self, events: list[WorkerEvent]) -> None:
        """Removes the given events (by identity): those a report delivered."""
        delivered = {id(event) for event in events}
        with self._lock:
            self._queues = tuple(
                deque(item for item in queue if id(item[1]) not in delivered) for queue in self._queues
            )

    def take(self) -> list[WorkerEvent]:
        """Removes and returns every event, in order."""
        with self._lock:
            merged = sorted(itertools.chain(*self._queues), key=lambda item: item[0])
            for queue in self._queues:
                queue.clear()
        return [event for _, event in merged]

    def _trim(self) -> None:
        while sum(len(queue) for queue in self._queues) > self._capacity:
            victim = next(queue for queue in self._queues if queue)
            victim.popleft()
            self._dropped += 1


class PoisonIsolation:
    """Finds an event the portal fails on (a 5xx every time it is in a report) so that it cannot
    hold the node's reports back for good: after a 5xx the next report carries half as many
    events, down to one; a single event that fails is tested against a report without events,
    and only when the portal takes those but fails on that event `tries` times in a row is the
    event dropped. A portal that fails on every report drops nothing."""

    def __init__(self, most: int, tries: int = 3) -> None:
        self.most = most
        self.tries = tries
        self.limit = most
        self.probing = False
        """The next report carries no events: does the portal take a report at all?"""
        self.portal_takes_reports = False
        self.failures = 0

    def batch_size(self) -> int:
        """How many of the oldest pending events the next report carries."""
        return 0 if self.probing else self.limit

    def succeeded(self, sent: list[WorkerEvent]) -> None:
        if not sent:
            if self.probing:
                self.probing, self.portal_takes_reports = False, True
            return
        self.limit, self.failures, self.portal_takes_reports = self.most, 0, False

    def server_failed(self, sent: list[WorkerEvent]) -> list[WorkerEvent]:
        """After a 5xx to a report that carried `sent`: returns the events to drop (the one the
        portal keeps failing on), usually none."""
        if not sent:
            self.probing, self.portal_takes_reports = False, False
            return []
        if len(sent) > 1:
            self.limit = max(1, len(sent) // 2)
            return []
        if self.portal_takes_reports:
            self.failures += 1
        if self.failures >= self.tries:
            self.limit, self.failures, self.portal_takes_reports = self.most, 0, False
            return sent
        self.probing = True
        return []
