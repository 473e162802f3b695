"""The one live socket. On connect it joins the cluster group and sends a snapshot of the
cluster; a client then subscribes to the jobs it may manage with
`{"action": "subscribe_job", "job_id": N}`. Anonymous sockets are refused at the handshake."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.layers import get_channel_layer

from portal.jobs.access import may_manage
from portal.jobs.board import cluster_state
from portal.jobs.models import Job
from portal.live.broadcast import CLUSTER_GROUP, job_group

UNAUTHENTICATED_CLOSE_CODE = 4401


def renew_every_s() -> float:
    """How often a socket renews its group memberships: a third of the layer's group expiry, so
    that a live socket never drops out while a dead one (its portal killed) does within it."""
    return float(getattr(get_channel_layer(), "group_expiry", 86400)) / 3


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED_CLOSE_CODE)
            return
        self.job_groups: set[str] = set()
        await self.channel_layer.group_add(CLUSTER_GROUP, self.channel_name)
        await self.accept()
        self._renewal = asyncio.create_task(self._renew_groups())
        await self.send_json({"type": "cluster", "cluster": await self._cluster()})

    async def _renew_groups(self) -> None:
        while True:
            await asyncio.sleep(renew_every_s())
            for group in (CLUSTER_GROUP, *self.job_groups):
                await self.channel_layer.group_add(group, self.channel_name)

    async def disconnect(self, code: int) -> None:
        if not hasattr(self, "job_groups"):
            return
        self._renewal.cancel()
        await self.channel_layer.group_discard(CLUSTER_GROUP, self.channel_name)
        for group in self.job_groups:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        action = content.get("action") if isinstance(content, dict) else None
        if action == "subscribe_job":
            await self._subscribe_job(content.get("job_id"))
        elif action == "unsubscribe_job" and isinstance(content.get("job_id"), int):
            group = job_group(content["job_id"])
            self.job_groups.discard(group)
            await self.channel_layer.group_discard(group, self.channel_name)
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

    async def live_event(self, message: dict[str, Any]) -> None:
        await self.send_json(message["event"])

    @database_sync_to_async
    def _may_manage(self, job_id: int) -> bool | None:
        job = Job.objects.filter(pk=job_id).first()
        return None if job is None else may_manage(self.scope["user"], job)

    @database_sync_to_async
    def _cluster(self) -> dict[str, Any]:
        return cluster_state()
