"""Which agent token speaks for which node. An agent token serves one node: the first
registration with a token claims the node's name for it, and from then on only that token may
register the node again (an agent restart) or report for it. A node no token holds (registered
before tokens were bound, or whose token was deleted) is claimed by the next token that
registers it, which is how an operator rotates a node's token.

A pool token (ApiToken.Role.POOL) serves no node itself. It may register a node only if the
name starts with its pool's prefix (`<pool>-`) and no token holds the node (a new node, or one
whose token was deleted); the registration then issues the node an agent token of its own,
linked to the pool token, bound here as any agent token is, and returned once. A pool token
never takes a node over from a token that holds it, even one issued by its own pool: an agent
that lost its node token registers under a new name, or an operator frees the node by deleting
its token (or it is lost and its jobs planned elsewhere, as for any silent node).

A pool token also registers only what its pool started: a leaked one must not add made-up nodes
that attract other users' jobs. A pool the portal starts itself says which names and how many
devices (portal.slurm: only its agent jobs, each once, with the devices it asked Slurm for),
through `add_pool_rules`; any other pool (a Kubernetes DaemonSet's, whose starts the portal never
sees) registers within the bound its operator set (BUNGEE_POOL_LIMITS: how many of its nodes at
once, how many devices each), and nothing where none is set."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings

from portal.accounts.models import LABEL_CHARS, ApiToken
from portal.cluster.models import Node
from portal.cluster.node_states import NodeState
from portal.errors import ApiError, forbidden

PoolRule = Callable[[str, int], None]
"""Checks that a pool token may register node `name` with `devices` devices (the node's name has
its pool's prefix, and no token holds it); raises ApiError 403 naming what it refuses. Called
inside the registration's transaction, with the pool token's row locked."""
LIVE_STATES = (NodeState.ONLINE, NodeState.UNREACHABLE, NodeState.DRAINING)
"""A node in these states is one its pool's agent still runs (or may come back to)."""
_pool_rules: list[Callable[[str], PoolRule | None]] = []


def add_pool_rules(rule_for: Callable[[str], PoolRule | None]) -> None:
    """Lets an app that starts a pool's agents itself say what that pool registers: `rule_for(pool)`
    is its rule for the pool named `pool`, or None for a pool it does not start. Apps call it
    once, when they are ready (portal.slurm.apps); cluster never imports them."""
    _pool_rules.append(rule_for)


def _serves_another(served: Node, name: str) -> ApiError:
    return forbidden(
        f"this agent token serves node {served.name!r}, not {name!r}; one agent token serves one "
        "node: issue another with manage.py create_token USER --role agent"
    )


def _held_by_another(name: str) -> ApiError:
    return forbidden(f"node {name!r} is registered with another agent token; each node's agent needs its own")


def _check_pool_claim(name: str, pool_token: ApiToken, devices: int) -> None:
    ApiToken.objects.select_for_update().filter(pk=pool_token.pk).first()
    prefix = pool_token.node_prefix
    if not name.startswith(prefix) or name == prefix:
        raise forbidden(
            f"this pool token registers only nodes of pool {pool_token.pool!r}, named {prefix!r} "
            f"followed by the node's own part; not {name!r}"
        )
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None and node.agent_token_id is not None:
        raise forbidden(
            f"node {name!r} is held by another agent token; a pool token only registers new nodes: "
            "an agent registers its node again with the node token its first registration returned"
        )
    for rule_for in _pool_rules:
        rule = rule_for(pool_token.pool)
        if rule is not None:
            rule(name, devices)
            return
    _check_pool_limit(name, pool_token.pool, devices)


def _check_pool_limit(name: str, pool: str, devices: int) -> None:
    """The operator's bound on a pool the portal does not start (BUNGEE_POOL_LIMITS)."""
    limit = settings.BUNGEE.pool_limit(pool)
    if limit is None:
        raise forbidden(
            f"pool {pool!r} registers no node, not {name!r}: the portal submits none of its agents and "
            f"BUNGEE_POOL_LIMITS sets no bound for it (add {pool}:NODES:DEVICES, docs/operator/security.md)"
        )
    most_nodes, most_devices = limit
    if devices > most_devices:
        raise forbidden(
            f"node {name!r} registers {devices} devices; a node of pool {pool!r} has at most {most_devices} "
            f"(BUNGEE_POOL_LIMITS {pool}:{most_nodes}:{most_devices})"
        )
    live = Node.objects.filter(name__startswith=f"{pool}-", state__in=LIVE_STATES).exclude(name=name).count()
    if live >= most_nodes:
        raise forbidden(
            f"node {name!r} would be the {live + 1}th node of pool {pool!r} at once; it has at most {most_nodes} "
            f"(BUNGEE_POOL_LIMITS {pool}:{most_nodes}:{most_devices}); a lost or drained node leaves room"
        )


def check_claim(name: str, token: ApiToken, devices: int) -> None:
    """Lets `token` register node `name` with `devices` devices, or raises ApiError 403 if
    another token holds the name or `token` already serves another node; for a pool token, if
    `name` is not of its pool, any token holds it, or its pool's rule refuses the name or the
    device count (see the module). Call it inside the registration's transaction: it locks the
    token's row and the node's, so that registrations with one token, or of one name, take
    turns."""
    if token.role == ApiToken.Role.POOL:
        _check_pool_claim(name, token, devices)
        return
    ApiToken.objects.select_for_update().filter(pk=token.pk).first()
    served = Node.objects.filter(agent_token=token).exclude(name=name).first()
    if served is not None:
        raise _serves_another(served, name)
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None and node.agent_token_id not in (None, token.pk):
        raise _held_by_another(name)


def bind(node: Node, token: ApiToken) -> str | None:
    """Records that `token` serves `node` (a no-op if it already does); for a pool token, issues
    the node an agent token of its own (owned by the pool token's user, `issued_by` it) and
    records that instead. Returns that node token's secret, which is stored nowhere (None for an
    agent token). Raises ApiError 403 if another token claimed the node since check_claim (two
    new agents racing for one name); the caller's transaction then undoes the issued token."""
    if node.agent_token_id == token.pk:
        return None
    secret = None
    if token.role == ApiToken.Role.POOL:
        label = f"pool {token.pool}: node {node.name}"[:LABEL_CHARS]
        token, secret = ApiToken.issue(token.user, label, ApiToken.Role.AGENT, issued_by=token)
    if Node.objects.filter(pk=node.pk, agent_token__isnull=True).update(agent_token=token) != 1:
        raise _held_by_another(node.name)
    node.agent_token = token
    return secret


def reporting_node(name: str, token: ApiToken) -> Node:
    """The node `token` reports for, if it is `name`. Raises ApiError 403 if `token` serves
    another node or another token holds `name`, and 409 "unknown_node" if `token` has not
    registered `name` and nobody else holds it: the agent then registers, which claims it."""
    node = Node.objects.filter(name=name).first()
    if node is not None and node.agent_token_id == token.pk:
        return node
    served = Node.objects.filter(agent_token=token).first()
    if served is not None:
        raise _serves_another(served, name)
    if node is not None and node.agent_token_id is not None:
        raise _held_by_another(name)
    raise ApiError(
        409, "unknown_node", f"node {name!r} has not registered with this agent token; register first"
    )
