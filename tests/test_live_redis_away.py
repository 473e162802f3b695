"""The live socket while Redis is away is refused as the API refuses (503 with Retry-After), not
failed: it closes with 1013, "try again later", which the page's socket backs off from
(static/js/live.js), and the portal logs one line, no traceback (portal.live.unavailable). At
the handshake (the channel layer's Redis does not answer), under an open socket (its Redis
killed), through the real server; and the database refusing the snapshot the same way. A socket
opened once Redis is back is served."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import channel_layers, get_channel_layer
from channels.testing import WebsocketCommunicator

from portal.asgi import application  # imported here: Django's setup resets logging, and caplog with it
from portal.live.broadcast import CLUSTER_GROUP
from portal.live.redis_connection import layer_host
from portal.live.unavailable import TRY_AGAIN_LATER_CLOSE_CODE
from portal.settings import CHANNEL_LAYER_TIMEOUTS
from tests.platform import redis_server, running_portal, seed_users

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def layer_at(settings: Any) -> Iterator[Any]:
    """Points the channel layer at a Redis URL of the test's (`layer_at(url)`)."""

    def point(url: str) -> None:
        settings.CHANNEL_LAYERS = {"default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [layer_host(url, **CHANNEL_LAYER_TIMEOUTS)], "prefix": "bungee-test-away"},
        }}
        channel_layers.backends.clear()

    yield point
    channel_layers.backends.clear()


def socket(token: str) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://127.0.0.1"), (b"authorization", f"Bearer {token}".encode())]
    return WebsocketCommunicator(application, "/ws/live/", headers=headers)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    return [r.getMessage() for r in caplog.records if r.name == "portal.live.unavailable"]


def test_a_handshake_while_redis_is_away_closes_with_try_again_later(
    tokens: dict, layer_at: Any, caplog: pytest.LogCaptureFixture
) -> None:
    layer_at("redis://127.0.0.1:1/0")  # nothing listens there

    async def scenario() -> dict[str, Any]:
        live = socket(tokens["alice"])
        connected, _ = await live.connect(timeout=30)
        assert connected, "accepted, so that the client sees the close code (a refused handshake is 1006)"
        closing = await live.receive_output(timeout=30)
        await live.wait(timeout=10)
        return closing

    with caplog.at_level(logging.INFO):
        closing = async_to_sync(scenario)()
    assert closing["type"] == "websocket.close" and closing["code"] == TRY_AGAIN_LATER_CLOSE_CODE
    assert closing["reason"] == "the portal's Redis is not answering; try again shortly"
    [line] = refusals(caplog)
    assert line.startswith("socket /ws/live/: closed with 1013, the portal's Redis is not answering: ")


def test_an_open_socket_whose_redis_dies_closes_with_try_again_later_and_one_opened_after_it_returns_is_served(
    tokens: dict, layer_at: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Once Redis is back (started again, empty, on the same port), a socket opened then gets its
    snapshot and the events sent to its groups: none of the layer's pooled connections to the
    Redis that died is used again (they failed its first commands, "Connection closed by
    server", and the socket closed with 1013 again)."""
    with redis_server("127.0.0.1", tmp_path / "redis") as server:
        layer_at(server.url)

        async def scenario() -> tuple[dict[str, Any], float, list[dict[str, Any]]]:
            live = socket(tokens["alice"])
            connected, _ = await live.connect(timeout=30)
            assert connected
            assert (await live.receive_json_from(timeout=30))["type"] == "cluster"
            server.kill()
            killed_at = time.monotonic()
            closing = await live.receive_output(timeout=60)
            await live.wait(timeout=10)
            after_s = time.monotonic() - killed_at

            server.start()
            again = socket(tokens["alice"])
            connected, _ = await again.connect(timeout=30)
            assert connected
            served = [await again.receive_output(timeout=30)]
            if served[0]["type"] == "websocket.send":
                await get_channel_layer().group_send(CLUSTER_GROUP, {"type": "live.event", "text": '{"type":"back"}'})
                served.append(await again.receive_output(timeout=30))
                await again.disconnect()
            return closing, after_s, served

        with caplog.at_level(logging.INFO):
            closing, after_s, served = async_to_sync(scenario)()
    print(f"closed {after_s:.2f} s after Redis was killed")
    assert closing["type"] == "websocket.close" and closing["code"] == TRY_AGAIN_LATER_CLOSE_CODE, closing
    assert [json.loads(message["text"])["type"] if "text" in message else message for message in served] == ["cluster", "back"]
    [line] = refusals(caplog)
    assert "the portal's Redis is not answering" in line


@pytest.mark.slow
def test_the_real_server_closes_the_handshake_with_1013_and_logs_no_traceback(tmp_path: Path) -> None:
    """The portal's own server (portal.launcher.portal_command), its Redis away from the start:
    a socket's handshake succeeds and the socket closes with 1013 at once, where the server
    answered the handshake 500 and logged the error's traceback."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with running_portal(tmp_path, {"REDIS_URL": "redis://127.0.0.1:1/0"}) as portal:
        tokens = seed_users(portal.group, [])
        url = portal.base_url.replace("http", "ws") + "/ws/live/"
        with connect(url, additional_headers={"Authorization": f"Bearer {tokens['alice']}"},
                     origin="http://127.0.0.1", open_timeout=30) as live:  # type: ignore[arg-type]
            with pytest.raises(ConnectionClosed) as closed:
                live.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == TRY_AGAIN_LATER_CLOSE_CODE
        log = portal.group.tail("portal", 500)
    assert "closed with 1013, the portal's Redis is not answering" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_the_database_away_at_the_snapshot_closes_the_same_way(
    tokens: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same detection as the API's 503 (portal.error_pages.unavailable_store): the database
    refusing while the socket's snapshot is read closes it with 1013 too."""
    from django.db import OperationalError

    from portal.live import consumers

    def refused() -> None:
        raise OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused")

    monkeypatch.setattr(consumers, "cluster_state", refused)

    async def scenario() -> dict[str, Any]:
        live = socket(tokens["alice"])
        connected, _ = await live.connect(timeout=30)
        assert connected
        closing = await live.receive_output(timeout=30)
        await live.wait(timeout=10)
        return closing

    with caplog.at_level(logging.INFO):
        closing = async_to_sync(scenario)()
    assert closing == {"type": "websocket.close", "code": TRY_AGAIN_LATER_CLOSE_CODE,
                       "reason": "the portal's database is not answering; try again shortly"}
    [line] = refusals(caplog)
    assert "the portal's database is not answering" in line
