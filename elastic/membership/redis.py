"""The job's membership board in Redis (the Board of elastic.membership.api): how the portal tells
a job's workers who is in which generation, and how joiners and the running group agree on the
moment of a resize.

Keys, under the job's coordination key K (elastic.wire.coordination_key):

    K:membership:<G>   the elastic.wire.Membership of generation G, as JSON; written once
    K:latest           the newest G published; it only ever grows
    K:ready:<G>        set of member keys ("node/device_index") of joiners ready for G
    K:go:<G>           list; the holders of the state push a token per joiner when they form G
    K:store:<G>        list; rank 0 pushes a token per other member once G's store listens: the
                       port it listens at
    K:alive:<member>   the pid of the worker process on that device, refreshed every
                       HEARTBEAT_EVERY_S by a thread of the worker and expiring HEARTBEAT_TTL_S
                       after the last refresh: how the portal knows a silent agent's workers
                       still live (elastic.worker.heartbeat)

The protocol, one generation G at a time (the worker's side is elastic.worker.rendezvous):

1. The portal publishes the record of G, then starts the joiners (new processes) through the
   agents. Survivors are not told anything; leavers are not either.
2. A joiner imports torch, builds its model, optimiser and data pipeline, then adds itself to
   K:ready:<G> and blocks on K:go:<G>. If a newer record appears meanwhile it starts over with
   that one (or leaves, if it is not a member any more).
3. Rank 0 of the running group watches K:latest from a background thread, never from the
   training loop. Once every member of G that is not in the running group is ready, it carries
   "switch to G" in the next step's all-reduce, so every rank switches after that same step.
4. At the switch rank 0 pushes the go tokens; leavers exit; survivors and joiners form G's
   process group and the joiners receive the training state from the survivors' memory
   (elastic.worker.transfer). Rank 0 makes G's TCPStore at the record's port (at one the
   kernel picks if another program holds that one) and then pushes a K:store:<G> token per
   other member, holding the port; they connect only after taking one, to that port, so a
   program that listens at the record's port is never mistaken for the store.
5. Holders of the state with no running group (a peer died and the group broke) wait until
   every joiner of G is ready, push the go tokens, and form G, unless a newer generation comes
   first.
6. With no holder at all (`has_state` false: the job's first start, or every worker was lost)
   the members form the group as soon as each is ready, and rank 0 restores the checkpoint.

Records expire after a day, so that a finished job leaves nothing behind for long. A call that
Redis does not answer is retried by the client (redis-py's Retry, exponential backoff, RETRIES
times, some 20 s in all) and then raises BoardUnavailable: nothing waits on the board for good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from elastic.membership.api import Board, BoardUnavailable
from elastic.wire import Membership

__all__ = ["HEARTBEAT_EVERY_S", "HEARTBEAT_TTL_S", "RECORD_TTL_S", "RETRIES", "RedisBoard", "heartbeat_key"]

RECORD_TTL_S = 24 * 3600
HEARTBEAT_EVERY_S = 2.0
HEARTBEAT_TTL_S = 10.0
"""A worker whose heartbeat is older than this is taken for dead (by whoever has no better
source: the portal, while the worker's agent is silent)."""
RETRIES = 12
"""Retries of a call that Redis does not answer; the waits between them double from 0.2 s up to
BACKOFF_CAP_S, about 20 s in all (plus each try's own socket timeout)."""
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
_ADVANCE_LATEST = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    return 1
end
return 0
"""

_T = TypeVar("_T")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def heartbeat_key(key: str, member: str) -> str:
    """The heartbeat key of the worker `member` ("node/device_index") of the job whose
    coordination key is `key`."""
    return f"{key}:alive:{member}"


def leave_key(key: str, member: str) -> str:
    """The key by which the portal tells the worker `member` of the job whose coordination key is
    `key` to leave: it holds the pid of the process told (its agent is gone, so no signal can
    reach it any other way)."""
    return f"{key}:leave:{member}"


LEAVE_TTL_S = 600.0
"""How long a word to leave waits for its worker to beat and read it."""


def retrying_client(url: str) -> redis.Redis:
    """A client of the Redis at `url` that retries a call that does not answer (see RETRIES)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
    )


class RedisBoard(Board):
    """The membership keys of one job, under `key` in the Redis that `client` talks to. Every
    method raises BoardUnavailable if Redis does not answer (after the client's own retries)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self._advance = client.register_script(_ADVANCE_LATEST)

    @classmethod
    def connect(cls, url: str, key: str) -> RedisBoard:
        """Returns the board of `key` at the Redis at `url`, with a retrying client of its own."""
        return cls(retrying_client(url), key)

    def _record_key(self, generation: int) -> str:
        return f"{self.key}:membership:{generation}"

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except redis.RedisError as err:
            raise BoardUnavailable(
                f"the membership board {self.key!r} did not answer ({what}): {err}"
            ) from err

    # --- the portal's side --------------------------------------------------------------------

    def publish(self, record: Membership) -> bool:
        """Stores `record` and makes it the latest unless a newer one is. Returns whether it
        became the latest."""

        def publish() -> bool:
            self.client.set(self._record_key(record.generation), record.model_dump_json(), ex=RECORD_TTL_S)
            advanced = self._advance(keys=[f"{self.key}:latest"], args=[record.generation, RECORD_TTL_S])
            return bool(advanced)

        return self._call(f"publishing generation {record.generation}", publish)

    # --- reading ------------------------------------------------------------------------------

    def latest_generation(self) -> int:
        """Returns the newest generation published, or 0 if none is."""
        value = self._call("reading the latest generation", lambda: self.client.get(f"{self.key}:latest"))
        return int(_text(value)) if value is not None else 0

    def record(self, generation: int) -> Membership | None:
        """Returns generation `generation`'s record, or None if there is none (or it expired)."""
        raw = self._call(
            f"reading generation {generation}", lambda: self.client.get(self._record_key(generation))
        )
        return None if raw is None else Membership.model_validate_json(_text(raw))

    # --- joiners and the switch ---------------------------------------------------------------

    def mark_ready(self, generation: int, member: str) -> None:
        """Says that the joiner `member` is built and waits for generation `generation`."""
        ready = f"{self.key}:ready:{generation}"

        def mark() -> None:
            pipe = self.client.pipeline()
            pipe.sadd(ready, member)
            pipe.expire(ready, RECORD_TTL_S)
            pipe.execute()

        self._call(f"marking {member} ready for generation {generation}", mark)

    def ready(self, generation: int) -> set[str]:
        """Returns the members that said they are ready for `generation`."""
        members = self._call(
            f"reading who is ready for generation {generation}",
            lambda: self.client.smembers(f"{self.key}:ready:{generation}"),
        )
        return {_text(member) for member in members}

    def send_go(self, generation: int, tokens: int) -> None:
        """Wakes up to `tokens` joiners waiting for `generation` (a token each)."""
        self._push_tokens("go", generation, tokens, f"waking the joiners of generation {generation}")

    def wait_go(self, generation: int, timeout_s: float) -> bool:
        """Takes one go token of `generation`, waiting up to `timeout_s`; returns whether one
        came."""
        token = self._take_token("go", generation, timeout_s, f"waiting for the go of generation {generation}")
        return token is not None

    def announce_store(self, generation: int, port: int, tokens: int) -> None:
        """Rank 0 of `generation` says that its store listens at `port`, to up to `tokens`
        members."""
        self._push_tokens(
            "store", generation, tokens, f"announcing the store of generation {generation}", str(port)
        )

    def wait_store(self, generation: int, timeout_s: float) -> int | None:
        """Takes one store token of `generation`, waiting up to `timeout_s`: the port rank 0's
        store listens at, or None if none came."""
        token = self._take_token("store", generation, timeout_s, f"waiting for the store of generation {generation}")
        return None if token is None else int(token)

    def _push_tokens(self, kind: str, generation: int, tokens: int, what: str, value: str = "") -> None:
        if tokens < 1:
            return
        name = f"{self.key}:{kind}:{generation}"

        def push() -> None:
            pipe = self.client.pipeline()
            pipe.rpush(name, *([value or kind] * tokens))
            pipe.expire(name, RECORD_TTL_S)
            pipe.execute()

        self._call(what, push)

    def _take_token(self, kind: str, generation: int, timeout_s: float, what: str) -> str | None:
        """One token's value, or None if none came within `timeout_s`."""
        token = self._call(what, lambda: self.client.blpop([f"{self.key}:{kind}:{generation}"], timeout=timeout_s))
        if token is None:
            return None
        value = token[1]
        return value.decode() if isinstance(value, bytes) else str(value)

    # --- heartbeats ---------------------------------------------------------------------------

    def beat(self, member: str, pid: int, ttl_s: float = HEARTBEAT_TTL_S) -> bool:
        """Says that the worker `member`, process `pid`, lives, for the next `ttl_s` seconds;
        returns whether that process was told to leave (tell_to_leave), in the same round trip.
        Raises redis.RedisError (the heartbeat's client does not retry: the next beat does)."""
        pipeline = self.client.pipeline(transaction=False)
        pipeline.set(heartbeat_key(self.key, member), pid, px=int(ttl_s * 1000))
        pipeline.get(leave_key(self.key, member))
        _, told = pipeline.execute()
        return told is not None and _text(told) == str(pid)

    def tell_to_leave(self, member: str, pid: int, ttl_s: float = LEAVE_TTL_S) -> None:
        """Tells the worker `member`, process `pid`, to leave at its next beat (it stops as on
        SIGTERM). A later process on the same device is not told."""
        self.client.set(leave_key(self.key, member), pid, px=int(ttl_s * 1000))

    def alive(self, member: str) -> int | None:
        """Returns the pid of `member` if its heartbeat is fresh, else None."""
        value = self._call(f"reading the heartbeat of {member}", lambda: self.client.get(heartbeat_key(self.key, member)))
        return None if value is None else int(_text(value))

    def close(self) -> None:
        self.client.close()
