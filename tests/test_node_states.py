"""The node state machine (portal.cluster.node_states): `Node.move` (the one way a node's state
changes) makes every listed transition and refuses every other one, leaving the row as it was; it
moves a node only from a state its caller names; and each listed transition is made by the writer
the table names (an agent's report or registration, the tick's `nodes_lost`, a drain), through
that writer's own code. A report writes its node's row once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.cluster import drain
from portal.cluster.ingest import node_seen, register_node
from portal.cluster.models import Node
from portal.cluster.node_states import NODE_TRANSITIONS, InvalidNodeTransition, NodeState
from portal.dispatch import board
from portal.jobs.lifecycle import nodes_lost
from portal.scheduling.cycle import run_cycle
from tests.conftest import cluster_registration
from tests.test_node_agent_restart import formed, silence
from tests.test_node_drain import notice
from tests.test_scheduler_cycle import report, submit

pytestmark = pytest.mark.django_db

ALLOWED = {(s, t) for s, targets in NODE_TRANSITIONS.items() for t in targets}
PAIRS = sorted(itertools.product(NodeState, NodeState))


def put(node: Node, state: NodeState) -> Node:
    """Test setup: the node's row in `state`, read back."""
    Node.objects.filter(pk=node.pk).update(state=state)
    return Node.objects.get(pk=node.pk)


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s.value}->{t.value}" for s, t in PAIRS])
def test_move_makes_a_listed_transition_and_refuses_any_other(
    cluster: Node, source: NodeState, target: NodeState
) -> None:
    node = put(cluster, source)
    if (source, target) in ALLOWED:
        assert node.move(target)
        assert node.state == target
    else:
        with pytest.raises(InvalidNodeTransition, match=f"from '{source.value}' to '{target.value}'"):
            node.move(target)
    assert Node.objects.get(pk=node.pk).state == (target if (source, target) in ALLOWED else source)


def test_move_refuses_every_source_named_unless_each_is_allowed(cluster: Node) -> None:
    """lost -> draining is not listed: naming it among allowed sources refuses the whole move."""
    node = put(cluster, NodeState.ONLINE)
    with pytest.raises(InvalidNodeTransition, match="from 'lost' to 'draining'"):
        node.move(NodeState.DRAINING, sources=(NodeState.ONLINE, NodeState.LOST))
    assert Node.objects.get(pk=node.pk).state == NodeState.ONLINE


def test_move_moves_once(cluster: Node) -> None:
    node = put(cluster, NodeState.ONLINE)
    stale_copy = Node.objects.get(pk=node.pk)
    assert node.move(NodeState.LOST)
    # A second writer read the node while it was online: its move must not move it again.
    assert not stale_copy.move(NodeState.UNREACHABLE)
    assert not stale_copy.move(NodeState.LOST)
    assert Node.objects.get(pk=node.pk).state == NodeState.LOST


def test_the_docstring_lists_every_transition() -> None:
    import portal.cluster.node_states as states

    doc = states.__doc__ or ""
    for source, target in ALLOWED:
        assert f"{source.value:<11} -> {target.value}" in doc, (source, target)


def _beating(api: dict[str, Any], node: Node) -> None:
    """A job runs on the node and its workers' heartbeats are fresh."""
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    for index, pid in formed(node, job, 1000):
        board(job.pk).beat(f"{node.name}/{index}", pid)


def _silent_and_lost(api: dict[str, Any], node: Node) -> None:
    silence(node)
    assert nodes_lost() == [node.name]


def _silent_and_unreachable(api: dict[str, Any], node: Node) -> None:
    _beating(api, node)
    silence(node)
    assert nodes_lost() == []


def _reported(api: dict[str, Any], node: Node) -> None:
    report(node)


def _registered(api: dict[str, Any], node: Node) -> None:
    register_node(cluster_registration())


def _drains(api: dict[str, Any], node: Node) -> None:
    assert drain.draining(node, notice())


def _left(api: dict[str, Any], node: Node) -> None:
    drain.left(node)


WRITERS: dict[tuple[NodeState, NodeState], Callable[[dict[str, Any], Node], None]] = {
    (NodeState.ONLINE, NodeState.UNREACHABLE): _silent_and_unreachable,
    (NodeState.ONLINE, NodeState.LOST): _silent_and_lost,
    (NodeState.ONLINE, NodeState.DRAINING): _drains,
    (NodeState.UNREACHABLE, NodeState.ONLINE): _reported,
    (NodeState.UNREACHABLE, NodeState.LOST): _silent_and_lost,
    (NodeState.UNREACHABLE, NodeState.DRAINING): _drains,
    (NodeState.LOST, NodeState.ONLINE): _reported,
    (NodeState.DRAINING, NodeState.DRAINED): _left,
    (NodeState.DRAINING, NodeState.LOST): _silent_and_lost,
    (NodeState.DRAINING, NodeState.ONLINE): _registered,
    (NodeState.DRAINED, NodeState.ONLINE): _registered,
}
"""Each listed transition, and the writer that makes it."""


def test_every_listed_transition_has_a_writer() -> None:
    assert set(WRITERS) == ALLOWED


@pytest.mark.parametrize(
    ("source", "target"), sorted(WRITERS), ids=[f"{s.value}->{t.value}" for s, t in sorted(WRITERS)]
)
def test_each_writer_makes_its_transition(
    api: dict[str, Any], cluster: Node, source: NodeState, target: NodeState
) -> None:
    node = put(cluster, source)
    WRITERS[source, target](api, node)
    assert Node.objects.get(pk=node.pk).state == target


@pytest.mark.parametrize("state", [NodeState.UNREACHABLE, NodeState.LOST])
def test_a_registration_brings_a_silent_node_online(cluster: Node, state: NodeState) -> None:
    put(cluster, state)
    node, _ = register_node(cluster_registration())
    assert node.state == NodeState.ONLINE == Node.objects.get(pk=node.pk).state


def _node_updates(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].startswith('UPDATE "cluster_node"')]


@pytest.mark.parametrize("state", list(NodeState))
def test_a_report_writes_its_node_once(cluster: Node, state: NodeState) -> None:
    """One UPDATE per report, whatever the node's state: its last report time, and the way back
    online of a silent node, together."""
    node = put(cluster, state)
    stale = timezone.now() - timedelta(seconds=5)
    Node.objects.filter(pk=node.pk).update(last_seen_at=stale)
    with CaptureQueriesContext(connection) as queries:
        node_seen(node)
    assert len(_node_updates(queries)) == 1, _node_updates(queries)
    row = Node.objects.get(pk=node.pk)
    assert row.last_seen_at > stale
    assert row.state == (NodeState.ONLINE if state in (NodeState.UNREACHABLE, NodeState.LOST) else state)


@pytest.mark.parametrize(
    ("read", "now"),
    [
        (NodeState.ONLINE, NodeState.LOST),
        (NodeState.ONLINE, NodeState.UNREACHABLE),
        (NodeState.LOST, NodeState.ONLINE),
        (NodeState.UNREACHABLE, NodeState.DRAINING),
    ],
)
def test_a_report_acts_on_the_state_the_node_is_in_not_the_one_read(
    cluster: Node, read: NodeState, now: NodeState
) -> None:
    """The tick marked the node silent (or it changed otherwise) after its report was read: the
    report still writes its time and brings a silent node back, as it would have a moment later."""
    node = put(cluster, read)
    put(node, now)
    stale = timezone.now() - timedelta(seconds=5)
    Node.objects.filter(pk=node.pk).update(last_seen_at=stale)
    node_seen(node)
    row = Node.objects.get(pk=node.pk)
    assert row.last_seen_at > stale
    assert row.state == (NodeState.ONLINE if now in (NodeState.UNREACHABLE, NodeState.LOST) else now)
