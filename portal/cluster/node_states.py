"""The node state machine. Its one performer is `Node.move` (portal.cluster.models), a conditional
UPDATE; its callers, each the writer of some transitions:

    online      -> unreachable  its agent is silent past NODE_TIMEOUT_S but its workers'
                                heartbeats are fresh (portal.jobs.lifecycle.nodes_lost)
    online      -> lost         silent, and no worker of its beats (nodes_lost)
    online      -> draining     its devices leave by `drain_deadline_at`: its agent got SIGTERM,
                                or an operator asked (portal.cluster.drain)
    unreachable -> online       its agent reports, or registers, again (portal.cluster.ingest)
    unreachable -> lost         the heartbeats stopped too, or the silence passed
                                UNREACHABLE_TIMEOUT_S (nodes_lost)
    unreachable -> draining     (portal.cluster.drain)
    lost        -> online       its agent reports, or registers, again (portal.cluster.ingest)
    draining    -> drained      its agent left with its workers gone (portal.cluster.drain.left)
    draining    -> lost         its agent fell silent mid-drain (nodes_lost)
    draining    -> online       an agent registers the node again (a report does not end a drain)
    drained     -> online       an agent registers the node again

A node is born online (its first registration). Any other transition raises
InvalidNodeTransition; `Node.move` moves a node only if it is still in a state the caller
names (by default the one it read), so that two writers racing cannot both move it.
"""

from __future__ import annotations

from django.db import models

from elastic.transitions import InvalidMove, check_move


class NodeState(models.TextChoices):
    ONLINE = "online"
    UNREACHABLE = "unreachable", "agent unreachable"
    LOST = "lost"
    DRAINING = "draining"
    DRAINED = "drained"


_N = NodeState
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _N.ONLINE: frozenset({_N.UNREACHABLE, _N.LOST, _N.DRAINING}),
    _N.UNREACHABLE: frozenset({_N.ONLINE, _N.LOST, _N.DRAINING}),
    _N.LOST: frozenset({_N.ONLINE}),
    _N.DRAINING: frozenset({_N.DRAINED, _N.LOST, _N.ONLINE}),
    _N.DRAINED: frozenset({_N.ONLINE}),
}

SILENT_STATES = frozenset({_N.UNREACHABLE, _N.LOST})
"""A node in these states comes back online with its agent's next report."""


class InvalidNodeTransition(InvalidMove):
    what = "a node"


def check_node_transition(source: str, target: str) -> None:
    """Raises InvalidNodeTransition unless a node may go from `source` to `target`."""
    check_move(NODE_TRANSITIONS, NodeState, source, target, InvalidNodeTransition)
