"""A node leaving gracefully, as the portal sees it: the only writer of the draining and drained
states (portal.cluster.node_states lists every transition).

A drain starts from the node's agent (its reports carry elastic.wire.DrainNotice once it got
SIGTERM from Slurm, Kubernetes or a person) or from an operator (`drain`, which also tells the
agent through its command stream). A draining node's devices are not usable (portal.scheduling
.snapshot), so the next cycle, asked for at once, plans its jobs without them: each shrinks in
place, moves, or saves its step and waits in the queue. The agent's last report says it left
(`left`): the node is drained until an agent registers it again."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from django.utils import timezone

from elastic.wire import DRAIN_CAUSES, DrainCause, DrainCommand, DrainNotice
from portal import dispatch
from portal.cluster.models import Node
from portal.live import broadcast
from portal.trigger import request_pool_pass, request_schedule

log = logging.getLogger(__name__)

_DRAINABLE = (Node.State.ONLINE, Node.State.UNREACHABLE)


def cause_text(node: Node) -> str:
    """Why the node drains, as a job's timeline says it ("node preempted by Slurm")."""
    return DRAIN_CAUSES.get(node.drain_cause, "node drained")


def draining(node: Node, notice: DrainNotice) -> bool:
    """The node's agent says its devices leave by `notice.deadline_at`: an online (or unreachable)
    node starts draining; a draining one takes a nearer deadline. Returns whether this call
    started the drain."""
    deadline_at = datetime.fromtimestamp(notice.deadline_at, tz=UTC)
    started = node.move(
        Node.State.DRAINING, sources=_DRAINABLE, drain_cause=notice.cause, drain_deadline_at=deadline_at
    )
    if not started:
        Node.objects.filter(pk=node.pk, state=Node.State.DRAINING, drain_deadline_at__gt=deadline_at).update(
            drain_deadline_at=deadline_at
        )
        return False
    node.refresh_from_db()
    log.warning("node %s drains (%s) by %s", node.name, cause_text(node), deadline_at.isoformat())
    request_schedule(f"node {node.name} drains: {cause_text(node)}")
    request_pool_pass(f"node {node.name} drains: {cause_text(node)}")
    _announce(node)
    return True


def drain(node: Node, deadline_s: float, cause: DrainCause = "operator") -> bool:
    """An operator drains the node: it starts draining now, and its agent is told to drain by
    the same deadline (it then exits). Returns whether this call started the drain (False: it
    was draining already, or is not online)."""
    notice = DrainNotice(cause=cause, deadline_at=(timezone.now() + timedelta(seconds=deadline_s)).timestamp())
    started = draining(node, notice)
    if started:
        dispatch.send(node.name, DrainCommand(deadline_s=deadline_s, cause=cause))
    return started


def left(node: Node) -> None:
    """The agent of a draining node left, its workers gone: the node is drained."""
    if node.move(Node.State.DRAINED, sources=(Node.State.DRAINING,)):
        node.refresh_from_db()
        log.info("node %s drained (%s): its agent left", node.name, cause_text(node))
        request_schedule(f"node {node.name} drained")
        request_pool_pass(f"node {node.name} drained")
        _announce(node)


def _announce(node: Node) -> None:
    broadcast.node_changed(
        node.name, node.state, node.last_seen_at, cause=cause_text(node), deadline_at=node.drain_deadline_at
    )
