"""The channel layer's Redis connections: a write bounded by a deadline that a cancellation
always ends.

redis-py 8 bounds a write with `asyncio.wait_for` when the connection has a socket timeout. On
Python 3.11 `wait_for` loses a cancellation that arrives in the same turn of the loop in which
the write finishes (fixed in 3.12, where `wait_for` is built on `asyncio.timeout`). Channels
cancels a consumer's pending receive from the layer when its socket closes; with the
cancellation lost, the receive went on popping the channel forever and the consumer never ended
(a test's event loop waited on it for ten minutes). Here the same deadline is kept with
`asyncio.timeout`, which lets a cancellation through; reads are bounded as redis-py bounds them.

Only the transport changes: what is sent, the errors raised and the connection dropped after a
failed write are redis-py's own.

The pool's maintenance notifications (a Redis Enterprise and Cloud feature, which redis-py 8
turns on by itself over RESP3) are off: while they are on, the pool skips its own check of a
connection it hands out (`ensure_connection`: data left unread, or the server's end closed), so
that after Redis came back the pool gave out connections to the Redis that had died, and the
first command on each failed with "Connection closed by server" (a socket opened after the
return closed with 1013). With them off, the pool drops such a connection and opens a new one
before the command is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig


class _CancellableWrite(AbstractConnection):
    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        deadline_s = self.socket_timeout
        if not deadline_s:
            await super().send_packed_command(command, check_health)
            return
        # redis-py's own write, without its wait_for (it takes none with no socket timeout), under
        # the same deadline. The connection is checked out to this one caller while it writes.
        self.socket_timeout = None
        try:
            async with asyncio.timeout(deadline_s):
                await super().send_packed_command(command, check_health)
        except TimeoutError:
            # super() dropped the connection when the deadline cancelled the write.
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = deadline_s


class CancellableConnection(_CancellableWrite, Connection):
    pass


class CancellableSSLConnection(_CancellableWrite, SSLConnection):
    pass


class CancellableUnixConnection(_CancellableWrite, UnixDomainSocketConnection):
    pass


_CANCELLABLE: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: CancellableConnection,
    SSLConnection: CancellableSSLConnection,
    UnixDomainSocketConnection: CancellableUnixConnection,
}


def layer_host(url: str, **options: Any) -> dict[str, Any]:
    """The channel layer's host entry for a Redis URL: the URL's own options (redis-py parses
    them, and picks a TCP, TLS or Unix socket connection by its scheme) with the cancellable
    variant of that connection, and the pool's maintenance notifications off (this module's
    docstring). Passing the URL as "address" would not do: its options win over any given, the
    connection class among them."""
    host = {**options, **parse_url(url)}
    host["connection_class"] = _CANCELLABLE[host.get("connection_class", Connection)]
    host["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return host
