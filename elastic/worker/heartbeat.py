"""The worker's heartbeat: a thread that refreshes the worker's short-lived key on the job's
membership board (elastic.membership.redis, K:alive:<member>) for as long as the process lives.

The agent reports its workers to the portal; when the agent dies, its workers train on, and the
heartbeat is how the portal tells a node whose agent is silent but whose workers live from a
node that is gone. Its answer is also how the portal reaches such workers: a worker told to
leave (the portal gave up on its silent agent) stops as on SIGTERM, the graceful stop every rank
agrees on at the next step boundary. It runs beside the training loop on a Redis connection of its own, so that a
slow or absent Redis never holds up a step; a beat that fails is tried again at the next one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import redis

from elastic.membership.redis import HEARTBEAT_EVERY_S, HEARTBEAT_TTL_S, RedisBoard

_REDIS_TIMEOUT_S = 2.0


class Heartbeat:
    """Beats for `member` (this process's pid) every `every_s` seconds from a daemon thread,
    from `start()` until `stop()`; calls `told_to_leave` once if a beat's answer says this
    process was told to leave (by default: SIGTERM to itself)."""

    def __init__(
        self,
        board: RedisBoard,
        member: str,
        every_s: float = HEARTBEAT_EVERY_S,
        ttl_s: float = HEARTBEAT_TTL_S,
        told_to_leave: Callable[[], None] | None = None,
    ) -> None:
        self._board = board
        self._member = member
        self._every_s = every_s
        self._ttl_s = ttl_s
        self._told_to_leave = told_to_leave or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    @classmethod
    def connect(cls, redis_url: str, key: str, member: str) -> Heartbeat:
        """Returns the heartbeat of `member` on the board `key` at `redis_url`, on a client of its
        own whose calls give up after a couple of seconds."""
        client = redis.Redis.from_url(
            redis_url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
        )
        return cls(RedisBoard(client, key), member)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops beating; the key expires by itself. Returns at once (a beat in flight may still
        land): the process is about to exit, and a leaver's device is wanted without delay."""
        self._stopping.set()

    def _run(self) -> None:
        pid = os.getpid()
        told = False
        while True:
            try:
                if self._board.beat(self._member, pid, self._ttl_s) and not told:
                    told = True
                    self._told_to_leave()
            except redis.RedisError:
                pass  # Redis is away: the next beat tries again; the membership code reports it
            if self._stopping.wait(self._every_s):
                return
