"""The membership board's contract (elastic.membership.Board), which every board must keep: the
Redis board against the real Redis (its own key prefix) and the in-memory board of the tests.
Then what only the Redis board does: its keys expire, its client retries a bounded number of
times, and a Redis that does not answer is BoardUnavailable."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from elastic.membership.api import Board, BoardUnavailable
from elastic.membership.redis import RECORD_TTL_S, RETRIES, RedisBoard, retrying_client
from elastic.worker.local import free_port
from tests.membership_support import MemoryBoard, key, record

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


def _redis_board() -> RedisBoard:
    return RedisBoard.connect(REDIS_URL, f"bungee-board-test-{uuid.uuid4().hex[:10]}:job:1")


@pytest.fixture(params=["memory", "redis"])
def board(request: pytest.FixtureRequest) -> Iterator[Board]:
    if request.param == "memory":
        yield MemoryBoard()
        return
    board = _redis_board()
    try:
        yield board
    finally:
        for stale in board.client.scan_iter(f"{board.key}:*"):
            board.client.delete(stale)
        board.close()


def test_an_empty_board_has_no_generation(board: Board) -> None:
    assert board.latest_generation() == 0
    assert board.latest() is None
    assert board.record(1) is None
    assert board.ready(1) == set()


def test_a_published_record_is_the_latest_and_reads_back_equal(board: Board) -> None:
    first = record(1, [0, 1], joiners=[0, 1], has_state=False)
    assert board.publish(first)
    assert board.latest_generation() == 1
    assert board.record(1) == first
    second = record(2, [1, 0, 2], joiners=[2], donor=None)
    assert board.publish(second)
    assert board.latest() == second
    assert board.record(1) == first


def test_the_latest_generation_never_goes_back(board: Board) -> None:
    assert board.publish(record(3, [0]))
    assert not board.publish(record(2, [0, 1], joiners=[1]))
    assert board.latest_generation() == 3
    assert board.record(2) == record(2, [0, 1], joiners=[1])


def test_ready_members_are_kept_per_generation(board: Board) -> None:
    board.mark_ready(2, key(1))
    board.mark_ready(2, key(2))
    board.mark_ready(2, key(1))
    board.mark_ready(3, key(4))
    assert board.ready(2) == {key(1), key(2)}
    assert board.ready(3) == {key(4)}
    assert board.ready(1) == set()


def test_each_go_token_wakes_one_waiter_of_its_generation(board: Board) -> None:
    board.send_go(2, 0)
    assert not board.wait_go(2, 0.01)
    board.send_go(2, 2)
    assert not board.wait_go(3, 0.01)
    assert board.wait_go(2, 0.01)
    assert board.wait_go(2, 0.01)
    assert not board.wait_go(2, 0.01)


def test_store_tokens_carry_the_port_and_are_apart_from_go_tokens(board: Board) -> None:
    board.announce_store(2, 29500, 0)
    assert board.wait_store(2, 0.01) is None
    board.announce_store(2, 41234, 2)
    board.send_go(2, 1)
    assert board.wait_store(3, 0.01) is None
    assert board.wait_store(2, 0.01) == 41234
    assert board.wait_store(2, 0.01) == 41234
    assert board.wait_store(2, 0.01) is None
    assert board.wait_go(2, 0.01)
    assert not board.wait_go(2, 0.01)


# --- the Redis board only --------------------------------------------------------------------


def test_every_key_of_the_redis_board_expires() -> None:
    board = _redis_board()
    try:
        board.publish(record(1, [0]))
        board.mark_ready(1, key(0))
        board.send_go(1, 1)
        board.announce_store(1, 29500, 1)
        keys = list(board.client.scan_iter(f"{board.key}:*"))
        assert len(keys) == 5  # the record, latest, ready, go, store
        assert all(0 < board.client.ttl(name) <= RECORD_TTL_S for name in keys)
    finally:
        for stale in board.client.scan_iter(f"{board.key}:*"):
            board.client.delete(stale)
        board.close()


def test_the_redis_client_retries_a_bounded_number_of_times() -> None:
    client = retrying_client(REDIS_URL)
    try:
        retry = client.get_retry()
        assert retry is not None
        assert 0 < retry.get_retries() == RETRIES
    finally:
        client.close()


def test_a_redis_that_does_not_answer_is_board_unavailable() -> None:
    port = free_port()  # nothing listens there
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 1))
    board = RedisBoard(client, "bungee-board-test:job:1")
    calls = [
        lambda: board.publish(record(1, [0])),
        board.latest_generation,
        lambda: board.record(1),
        lambda: board.mark_ready(1, key(0)),
        lambda: board.ready(1),
        lambda: board.send_go(1, 1),
        lambda: board.wait_go(1, 0.01),
    ]
    for call in calls:
        with pytest.raises(BoardUnavailable, match="bungee-board-test:job:1"):
            call()
    board.close()
