"""The job's membership board in Redis: how the portal tells a job's workers who is in which
generation, and how joiners and the running group agree on the moment of a resize.

Keys, under the job's coordination key K (elastic.wire.coordination_key):

    K:membership:<G>   the elastic.wire.Membership of generation G, as JSON; written once
    K:latest           the newest G published; it only ever grows
    K:ready:<G>        set of member keys ("node/device_index") of joiners ready for G
    K:go:<G>           list; the running group pushes tokens here when it switches to G
    K:alive:<member>   the pid of the worker process on that device, refreshed every
                       HEARTBEAT_EVERY_S by a thread of the worker and expiring HEARTBEAT_TTL_S
                       after the last refresh: how the portal knows a silent agent's workers
                       still live (elastic.worker.heartbeat)

The protocol, one generation G at a time:

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
   (elastic.worker.transfer).
5. With no running group (`has_state` false: the job's first start, or every worker was lost)
   the members form the group as soon as each is ready, and rank 0 restores the checkpoint.

Records expire after a day, so that a finished job leaves nothing behind for long.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from elastic.wire import Membership

log = logging.getLogger(__name__)

RECORD_TTL_S = 24 * 3600
HEARTBEAT_EVERY_S = 2.0
HEARTBEAT_TTL_S = 10.0
"""A worker whose heartbeat is older than this is taken for dead (by whoever has no better
source: the portal, while the worker's agent is silent)."""
_ADVANCE_LATEST = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    return 1
end
return 0
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def heartbeat_key(key: str, member: str) -> str:
    """The heartbeat key of the worker `member` ("node/device_index") of the job whose
    coordination key is `key`."""
    return f"{key}:alive:{member}"


class MembershipBoard:
    """The membership keys of one job, under `key` in the Redis that `client` talks to. Every
    method raises redis.RedisError if Redis does not answer."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self._advance = client.register_script(_ADVANCE_LATEST)

    @classmethod
    def connect(cls, url: str, key: str) -> MembershipBoard:
        """Returns the board of `key` at the Redis at `url` (a client of its own)."""
        return cls(redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5), key)

    def _record_key(self, generation: int) -> str:
        return f"{self.key}:membership:{generation}"

    # --- the portal's side --------------------------------------------------------------------

    def publish(self, record: Membership) -> bool:
        """Stores `record` and makes it the latest unless a newer one is. Returns whether it
        became the latest."""
        self.client.set(self._record_key(record.generation), record.model_dump_json(), ex=RECORD_TTL_S)
        advanced = self._advance(keys=[f"{self.key}:latest"], args=[record.generation, RECORD_TTL_S])
        return bool(advanced)

    # --- reading ------------------------------------------------------------------------------

    def latest_generation(self) -> int:
        """Returns the newest generation published, or 0 if none is."""
        value = self.client.get(f"{self.key}:latest")
        return int(_text(value)) if value is not None else 0

    def record(self, generation: int) -> Membership | None:
        """Returns generation `generation`'s record, or None if there is none (or it expired)."""
        raw = self.client.get(self._record_key(generation))
        return None if raw is None else Membership.model_validate_json(_text(raw))

    def latest(self) -> Membership | None:
        """Returns the newest record, or None if there is none."""
        generation = self.latest_generation()
        return self.record(generation) if generation else None

    # --- joiners and the switch ---------------------------------------------------------------

    def mark_ready(self, generation: int, member: str) -> None:
        """Says that the joiner `member` is built and waits for generation `generation`."""
        ready = f"{self.key}:ready:{generation}"
        self.client.pipeline().sadd(ready, member).expire(ready, RECORD_TTL_S).execute()

    def ready(self, generation: int) -> set[str]:
        """Returns the members that said they are ready for `generation`."""
        return {_text(member) for member in self.client.smembers(f"{self.key}:ready:{generation}")}

    def send_go(self, generation: int, tokens: int) -> None:
        """Wakes up to `tokens` joiners waiting for `generation` (a token each)."""
        if tokens < 1:
            return
        go = f"{self.key}:go:{generation}"
        self.client.pipeline().rpush(go, *(["go"] * tokens)).expire(go, RECORD_TTL_S).execute()

    def wait_go(self, generation: int, timeout_s: float) -> bool:
        """Takes one go token of `generation`, waiting up to `timeout_s`; returns whether one
        came."""
        return self.client.blpop([f"{self.key}:go:{generation}"], timeout=timeout_s) is not None

    # --- heartbeats ---------------------------------------------------------------------------

    def beat(self, member: str, pid: int, ttl_s: float = HEARTBEAT_TTL_S) -> None:
        """Says that the worker `member`, process `pid`, lives, for the next `ttl_s` seconds."""
        self.client.set(heartbeat_key(self.key, member), pid, px=int(ttl_s * 1000))

    def alive(self, member: str) -> int | None:
        """Returns the pid of `member` if its heartbeat is fresh, else None."""
        value = self.client.get(heartbeat_key(self.key, member))
        return None if value is None else int(_text(value))

    def close(self) -> None:
        self.client.close()
