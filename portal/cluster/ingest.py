"""What agents tell the portal about their nodes: registration, and the device samples of the
report they send every interval (worker events go to portal.jobs.ingest). The database stays the
source of truth; samples' latest values go to Redis and, downsampled, to the history table."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from pydantic import TypeAdapter

from elastic.wire import DeviceSample, NodeRegistration, RegistrationReply
from portal.cluster.models import Device, Node, ReportRefusals
from portal.cluster.models import DeviceSample as DeviceSampleRow
from portal.cluster.node_states import SILENT_STATES
from portal.cluster.state import latest_key
from portal.dispatch import stream_for
from portal.live import broadcast
from portal.live.samples import changed
from portal.redis import client
from portal.redis_users import new_node_user
from portal.trigger import request_pool_pass, request_schedule

log = logging.getLogger(__name__)

LATEST_SAMPLE_TTL_S = 60


def _at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


def register_node(registration: NodeRegistration) -> tuple[Node, RegistrationReply]:
    """Create or refresh the node and its devices. A device the agent no longer reports is
    marked absent (its history is kept). Asks the scheduler to run. What becomes of the node's
    workers is the jobs' lifecycle's to say (portal.jobs.lifecycle.node_registered)."""
    now = timezone.now()
    with transaction.atomic():
        node, _ = Node.objects.update_or_create(
            name=registration.name,
            defaults={
                "address": registration.address,
                "backend": registration.backend,
                "last_seen_at": now,
                "drain_cause": "",
                "drain_deadline_at": None,
            },
        )
        if node.state != Node.State.ONLINE:  # read with the row locked (update_or_create)
            node.move(Node.State.ONLINE)
        # In a few statements whatever the node's size (one a device took over 10 s, the agent's
        # timeout, for 1,024 devices on a loaded machine): the node's devices read once, the
        # new ones inserted together, the known ones updated together.
        known = {device.index: device for device in node.devices.select_for_update()}
        added: list[Device] = []
        for info in registration.devices:
            device = known.get(info.index) or Device(node=node, index=info.index)
            device.uuid, device.name, device.kind = info.uuid, info.name, info.kind
            device.memory_total_bytes, device.present = info.memory_total_bytes, True
            if device.pk is None:
                added.append(device)
        Device.objects.bulk_create(added)
        reported = {info.index for info in registration.devices}
        Device.objects.bulk_update([d for i, d in known.items() if i in reported],
                                   ["uuid", "name", "kind", "memory_total_bytes", "present"], batch_size=1000)
        node.devices.exclude(index__in=reported).update(present=False)
        request_schedule(f"node {node.name} registered")
    # After the node's row is written: a registration that fails there makes no user. A user
    # made for a registration whose reply is lost is harmless (the next one resets its password).
    commands_redis_url, password_sha256 = new_node_user(node.name)
    Node.objects.filter(pk=node.pk).update(redis_password_sha256=password_sha256)
    node.redis_password_sha256 = password_sha256
    reply = RegistrationReply(
        node_id=node.pk,
        commands_redis_url=commands_redis_url,
        commands_stream=stream_for(node.name),
        report_interval_s=settings.BUNGEE.report_interval_s,
    )
    return node, reply


OVERDUE_CHECK_EVERY_S = 1.0
_overdue_checked_at = 0.0


def node_seen(node: Node) -> None:
    """The node reported: it is online (again), unless it drains (a drain ends only with a new
    registration: portal.cluster.drain). Its report is also the moment to notice, at
    most once a second in this process, that another node has been silent past NODE_TIMEOUT_S:
    the scheduler cycle then marks it lost. The beat's tick does the same; this way a dead beat
    cannot leave a silent node "online" while any other node reports."""
    global _overdue_checked_at
    came_back = node.state == Node.State.LOST
    now = timezone.now()
    if _seen(node, now):
        broadcast.node_changed(node.name, Node.State.ONLINE.value, now)
    if came_back:
        request_schedule(f"node {node.name} is back")
    if time.monotonic() - _overdue_checked_at < OVERDUE_CHECK_EVERY_S:
        return
    _overdue_checked_at = time.monotonic()
    deadline = now - timedelta(seconds=settings.BUNGEE.node_timeout_s)
    silent_states = (Node.State.ONLINE, Node.State.UNREACHABLE, Node.State.DRAINING)
    overdue = Node.objects.filter(state__in=silent_states, last_seen_at__lt=deadline).exclude(pk=node.pk)
    if overdue.exists():
        request_schedule(f"node(s) {', '.join(overdue.values_list('name', flat=True)[:5])} silent past the timeout")


def _seen(node: Node, now: datetime) -> bool:
    """Writes `now` as the node's last report, and brings a silent node (unreachable, lost) back
    online, in one UPDATE: the state the caller read says which UPDATE to try; the other one
    follows only if the state changed since (a tick marked the node unreachable or lost, or
    another report brought it back). Returns whether this call brought it back online."""
    bring_back_first = node.state in SILENT_STATES
    for bring_back in (bring_back_first, not bring_back_first):
        if bring_back:
            if node.move(Node.State.ONLINE, sources=SILENT_STATES, last_seen_at=now):
                return True
        elif Node.objects.filter(pk=node.pk).exclude(state__in=SILENT_STATES).update(last_seen_at=now):
            return False
    return False


def count_refused(node: Node, reason: ReportRefusals.Reason, count: int) -> None:
    """Adds `count` refused items of `node`'s reports to its count for `reason` (/metrics)."""
    if count <= 0:
        return
    ReportRefusals.objects.get_or_create(node=node, reason=reason)
    ReportRefusals.objects.filter(node=node, reason=reason).update(count=F("count") + count)


def ingest_samples(node: Node, samples: list[DeviceSample]) -> None:
    """Stores each sample as its device's latest (Redis), sends the sockets one message for the
    node with what changed since each device's previous sample (portal.live.samples.changed),
    read back by the same Redis call that stores the new one, and only then writes the
    database: an owner's coming or going, and every SAMPLE_HISTORY_EVERY_S the history table
    (a history tick wrote 1,024 rows before the sockets heard of the report, and was the live
    board's slowest second)."""
    now = timezone.now()
    # Plain tuples, not model instances: a report of 1,024 devices built 1,024 Devices (45 ms).
    devices = {index: (pk, owner_present, last_history_at) for index, pk, owner_present, last_history_at
               in node.devices.values_list("index", "pk", "owner_present", "last_history_at")}
    kept = [(sample, devices[sample.index]) for sample in samples if sample.index in devices]
    stored = _SAMPLES.dump_python([sample for sample, _ in kept], mode="json")
    for payload, (_, device) in zip(stored, kept, strict=True):
        payload["device_id"] = device[0]
    previous = _store_latest([latest_key(device[0]) for _, device in kept], [json.dumps(p) for p in stored])
    outgoing = [changed(json.loads(old) if old else None, payload) for old, payload in zip(previous, stored, strict=True)]
    broadcast.samples(node.pk, node.name, outgoing)

    history_cutoff = now - timedelta(seconds=settings.BUNGEE.sample_history_every_s)
    history: list[DeviceSampleRow] = []
    for sample, (pk, owner_present, last_history_at) in kept:
        if sample.owner_present != owner_present:
            _owner_changed(pk, sample.owner_present, now)
        if last_history_at is None or last_history_at <= history_cutoff:
            history.append(
                DeviceSampleRow(
                    device_id=pk,
                    taken_at=_at(sample.taken_at),
                    utilization_pct=sample.utilization_pct,
                    memory_used_bytes=sample.memory_used_bytes,
                    temperature_c=sample.temperature_c,
                    power_w=sample.power_w,
                )
            )
    if history:
        DeviceSampleRow.objects.bulk_create(history)
        Device.objects.filter(pk__in=[row.device_id for row in history]).update(last_history_at=now)


# Every sample of a report stored as its device's latest, each key's previous value returned: one
# command for the whole report (a pipeline of 1,024 SETs took 20-30 ms of the portal to pack).
_SET_ALL = """
local previous = {}
for i, key in ipairs(KEYS) do
  previous[i] = redis.call('SET', key, ARGV[i + 1], 'EX', ARGV[1], 'GET')
end
return previous
"""
_SAMPLES = TypeAdapter(list[DeviceSample])


def _store_latest(keys: list[str], values: list[str]) -> list[bytes | None]:
    if not keys:
        return []
    return client().register_script(_SET_ALL)(keys=keys, args=[LATEST_SAMPLE_TTL_S, *values])  # type: ignore[no-any-return]


def _owner_changed(device_pk: int, present: bool, now: datetime) -> None:
    Device.objects.filter(pk=device_pk).update(owner_present=present, owner_since=now if present else None)
    device = Device.objects.select_related("node").get(pk=device_pk)
    what = "took back" if present else "released"
    log.info("device %s: its owner %s it", device, what)
    request_schedule(f"owner {what} {device}")
    if present:
        request_pool_pass(f"owner {what} {device}")
