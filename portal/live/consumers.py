"""The one live socket. On connect it joins the cluster group and the samples of every node and
sends a snapshot of the cluster and its active jobs (portal.jobs.board.cluster_state); a client
then subscribes to the jobs it may manage with `{"action": "subscribe_job", "job_id": N}`, and
may narrow the samples to what its page shows
with `{"action": "subscribe_samples", "nodes": ["name", ...], "device_ids": [N, ...]}` (either
may be left out; `{"action": "subscribe_samples", "all": true}` widens them again to every
node). Anonymous sockets are refused at the handshake.

What the groups send a socket goes through its outbox (portal.live.outbox) and is written by a
task of its own: a browser that reads slower than the portal sends holds up only that task, the
newest state of each job replaces an older one still waiting, and a socket with more than
BUNGEE_LIVE_OUTBOX_LIMIT other messages waiting is closed with 4429 (its page reconnects and
starts from a snapshot). With BUNGEE_LIVE_COALESCE off each message is written as it comes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.layers import get_channel_layer
from django.conf import settings

from portal.cluster.models import Device, Node
from portal.jobs.access import may_manage
from portal.jobs.board import cluster_state
from portal.jobs.models import Job
from portal.live.broadcast import CLUSTER_GROUP, SAMPLES_GROUP, encoded, job_group, node_samples_group
from portal.live.outbox import Outbox, OutboxFullError
from portal.live.samples import Subscription

log = logging.getLogger(__name__)

UNAUTHENTICATED_CLOSE_CODE = 4401
TOO_FAR_BEHIND_CLOSE_CODE = 4429
MAX_SUBSCRIBED = 10_000


def renew_every_s() -> float:
    """How often a socket renews its group memberships: a third of the layer's group expiry, so
    that a live socket never drops out while a dead one (its portal killed) does within it."""
    return float(getattr(get_channel_layer(), "group_expiry", 86400)) / 3


class SharedSnapshot:
    """One cluster snapshot for every socket of this process that connects at about the same
    time (a portal restart reconnects every board at once): a socket takes a snapshot begun
    after it joined its groups, so that none misses an event sent in between, and shares it
    with the others that joined before it began."""

    def __init__(self, build: Callable[[], Awaitable[str]]) -> None:
        self.build = build
        self.started_at = 0.0
        self.task: asyncio.Task[str] | None = None

    async def after(self, joined_at: float) -> str:
        """The snapshot's JSON text, begun at or after `joined_at` (time.monotonic())."""
        while True:
            task = self.task
            if task is not None and task.get_loop() is not asyncio.get_running_loop():
                task = self.task = None
            if task is not None and self.started_at >= joined_at:
                return await asyncio.shield(task)
            if task is not None and not task.done():
                await asyncio.wait([task])
                continue
            self.started_at = time.monotonic()
            self.task = asyncio.ensure_future(self.build())


@database_sync_to_async
def _cluster_text() -> str:
    return encoded({"type": "cluster", "cluster": cluster_state()})


snapshots = SharedSnapshot(_cluster_text)


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # An error (Redis gone under an open socket) ends the consumer without `disconnect`;
            # its renewals and its writer must not go on for a socket that is no more.
            for task in (getattr(self, "_renewal", None), getattr(self, "_writer", None)):
                if task is not None:
                    task.cancel()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED_CLOSE_CODE)
            return
        self.job_groups: set[str] = set()
        self.subscription = Subscription()
        self._outbox: Outbox | None = Outbox(settings.BUNGEE.live_outbox_limit) if settings.BUNGEE.live_coalesce else None
        self._waiting = asyncio.Event()
        self._behind = False  # closed for being too far behind: nothing more is written
        joined_at = time.monotonic()
        for group in self._groups():
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        self._renewal = asyncio.create_task(self._renew_groups())
        await self.send(text_data=await snapshots.after(joined_at))
        # Started after the snapshot: what the groups sent meanwhile waits for it, and follows it.
        self._writer = asyncio.create_task(self._write_outbox())

    def _sample_groups(self) -> set[str]:
        if self.subscription.everything:
            return {SAMPLES_GROUP}
        return {node_samples_group(node_id) for node_id in self.subscription.followed_nodes()}

    def _groups(self) -> set[str]:
        return {CLUSTER_GROUP, *self.job_groups, *self._sample_groups()}

    async def _renew_groups(self) -> None:
        while True:
            await asyncio.sleep(renew_every_s())
            for group in self._groups():
                await self.channel_layer.group_add(group, self.channel_name)

    async def _write_outbox(self) -> None:
        # A browser gone makes the server refuse the write; the socket's disconnect follows.
        with suppress(OSError):
            while True:
                await self._waiting.wait()
                self._waiting.clear()
                if self._outbox is None:
                    return
                for text in self._outbox.take():
                    await self.send(text_data=text)

    async def _deliver(self, text: str) -> None:
        """Writes a group's message, through the outbox when there is one."""
        if self._behind:
            return
        if self._outbox is None:
            await self.send(text_data=text)
            return
        try:
            self._outbox.put(text)
        except OutboxFullError as full:
            await self._too_far_behind(full)
            return
        self._waiting.set()

    async def _too_far_behind(self, full: OutboxFullError) -> None:
        # What waits is dropped, and the writer with it (it waits on the browser, which reads
        # nothing); the page reconnects and its snapshot is whole.
        log.warning("live socket of %s closed with %s: %s", self.scope["user"].get_username(),
                    TOO_FAR_BEHIND_CLOSE_CODE, full)
        self._behind = True
        self._outbox = None
        self._writer.cancel()
        await self.close(code=TOO_FAR_BEHIND_CLOSE_CODE)

    async def disconnect(self, code: int) -> None:
        if not hasattr(self, "job_groups"):
            return
        self._renewal.cancel()
        if hasattr(self, "_writer"):
            self._writer.cancel()
        for group in self._groups():
            await self.channel_layer.group_discard(group, self.channel_name)
        # One line a socket, as the ASGI server's access log said before it was turned off.
        log.info("live socket of %s closed (code %s)", self.scope["user"].get_username(), code)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        action = content.get("action") if isinstance(content, dict) else None
        if action == "subscribe_job":
            await self._subscribe_job(content.get("job_id"))
        elif action == "unsubscribe_job" and isinstance(content.get("job_id"), int):
            group = job_group(content["job_id"])
            self.job_groups.discard(group)
            await self.channel_layer.group_discard(group, self.channel_name)
        elif action == "subscribe_samples":
            await self._subscribe_samples(content)
        else:
            await self.send_json({"type": "error", "message": f"unknown action {action!r}"})

    async def _subscribe_job(self, job_id: Any) -> None:
        if not isinstance(job_id, int):
            await self.send_json({"type": "error", "message": f"job_id must be an integer, not {job_id!r}"})
            return
        allowed = await self._may_manage(job_id)
        if allowed is None:
            await self.send_json({"type": "error", "job_id": job_id, "message": f"job {job_id} does not exist"})
            return
        if not allowed:
            await self.send_json(
                {"type": "error", "job_id": job_id, "message": f"job {job_id} is not yours; only its owner and staff may follow it"}
            )
            return
        group = job_group(job_id)
        self.job_groups.add(group)
        await self.channel_layer.group_add(group, self.channel_name)
        await self.send_json({"type": "subscribed", "job_id": job_id})

    async def _subscribe_samples(self, content: dict[str, Any]) -> None:
        """Replaces what samples this socket follows; answers `subscribed_samples` with the
        nodes and devices it now follows (names and ids that name nothing are left out)."""
        nodes, device_ids = content.get("nodes", []), content.get("device_ids", [])
        if content.get("all") is True:
            subscription = Subscription()
        elif not (_list_of(nodes, str) and _list_of(device_ids, int)):
            await self.send_json({"type": "error", "message": f"nodes must be a list of at most {MAX_SUBSCRIBED} names "
                                  f"and device_ids one of integers, not {nodes!r} and {device_ids!r}"})
            return
        else:
            subscription = await self._subscription(nodes, device_ids)
        before = self._sample_groups()
        self.subscription = subscription
        after = self._sample_groups()
        for group in after - before:
            await self.channel_layer.group_add(group, self.channel_name)
        for group in before - after:
            await self.channel_layer.group_discard(group, self.channel_name)
        await self.send_json({"type": "subscribed_samples", **await self._described(subscription)})

    async def live_event(self, message: dict[str, Any]) -> None:
        await self._deliver(message["text"] if "text" in message else encoded(message["event"]))

    async def live_jobs(self, message: dict[str, Any]) -> None:
        """Job summaries for the boards (portal.live.broadcast): kept as the newest of each job."""
        if self._behind:
            return
        if self._outbox is None:
            await self.send(text_data=message["text"])
            return
        self._outbox.put_jobs([(job_id, summary) for job_id, summary in message["jobs"]])
        self._waiting.set()

    async def live_samples(self, message: dict[str, Any]) -> None:
        wanted = self.subscription.wants(message["node_id"])
        if wanted is True:
            await self._deliver(message["text"])
        elif wanted and "rows" in message:
            # Without rows: the message for the sockets following every node, which this one
            # left a moment ago; the node's own message, with its rows, comes too.
            rows = [row for row in message["rows"] if row["device_id"] in wanted]
            if rows:
                await self._deliver(encoded(message["head"] | {"samples": rows}))

    @database_sync_to_async
    def _may_manage(self, job_id: int) -> bool | None:
        job = Job.objects.filter(pk=job_id).first()
        return None if job is None else may_manage(self.scope["user"], job)

    @database_sync_to_async
    def _subscription(self, nodes: list[str], device_ids: list[int]) -> Subscription:
        subscription = Subscription(everything=False)
        subscription.node_ids = set(Node.objects.filter(name__in=nodes).values_list("pk", flat=True))
        for device_id, node_id in Device.objects.filter(pk__in=device_ids).values_list("pk", "node_id"):
            subscription.device_ids.setdefault(node_id, set()).add(device_id)
        return subscription

    @database_sync_to_async
    def _described(self, subscription: Subscription) -> dict[str, Any]:
        if subscription.everything:
            return {"all": True, "nodes": [], "device_ids": []}
        names = Node.objects.filter(pk__in=subscription.node_ids).order_by("name").values_list("name", flat=True)
        devices = sorted(d for ids in subscription.device_ids.values() for d in ids)
        return {"all": False, "nodes": list(names), "device_ids": devices}


def _list_of(value: Any, kind: type) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_SUBSCRIBED
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in value))
