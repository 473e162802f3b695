"""A worker whose agent is gone can still be told to leave: the portal writes the word on the job's
board (RedisBoard.tell_to_leave), and the worker's heartbeat reads it in the round trip of its
next beat and stops its process as SIGTERM does (the graceful stop). Only the process told
leaves: another one on the same device is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid

import redis

from elastic.membership.redis import RedisBoard
from elastic.worker.heartbeat import Heartbeat
from portal.launcher import ROOT

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
MEMBER = "node-a/0"


def fresh_key() -> str:
    return f"bungee-leave-test-{uuid.uuid4().hex[:10]}:job:1"


class CountingBoard(RedisBoard):
    """Counts its beats, so that a test waits for beats, not for time."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        super().__init__(client, key)
        self.beats = 0
        self.beaten = threading.Condition()

    def beat(self, member: str, pid: int, ttl_s: float = 10.0) -> bool:
        told = super().beat(member, pid, ttl_s)
        with self.beaten:
            self.beats += 1
            self.beaten.notify_all()
        return told

    def await_beats(self, count: int) -> None:
        with self.beaten:
            target = self.beats + count
            assert self.beaten.wait_for(lambda: self.beats >= target, timeout=30), f"{count} beats within 30 s"


def test_a_heartbeat_told_to_leave_calls_its_handler_once() -> None:
    key = fresh_key()
    calls: list[int] = []
    board = CountingBoard(redis.Redis.from_url(REDIS_URL), key)
    heartbeat = Heartbeat(board, MEMBER, every_s=0.02, told_to_leave=lambda: calls.append(1)).start()
    portal = RedisBoard.connect(REDIS_URL, key)
    try:
        portal.tell_to_leave(MEMBER, os.getpid() + 1)  # another process on the device
        board.await_beats(3)
        assert calls == [], "a word for another pid is not this worker's"
        portal.tell_to_leave(MEMBER, os.getpid())
        board.await_beats(3)
        assert calls == [1], "read at the next beat, and acted on once however many beats read it"
    finally:
        heartbeat.stop()
        portal.client.delete(*portal.client.keys(f"{key}:*"))


def test_a_worker_process_told_to_leave_is_stopped_as_by_sigterm() -> None:
    key = fresh_key()
    program = (
        "import sys, time\n"
        "from elastic.membership.redis import RedisBoard\n"
        "from elastic.worker.heartbeat import Heartbeat\n"
        f"Heartbeat(RedisBoard.connect({REDIS_URL!r}, {key!r}), {MEMBER!r}, every_s=0.05).start()\n"
        "print('beating', flush=True)\n"
        "time.sleep(120)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    portal = RedisBoard.connect(REDIS_URL, key)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "beating"
        portal.tell_to_leave(MEMBER, process.pid)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()
        portal.client.delete(*portal.client.keys(f"{key}:*"))
