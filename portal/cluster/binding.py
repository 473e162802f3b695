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
its token (or it is lost and its jobs planned elsewhere, as for any silent node)."""

from __future__ import annotations

from portal.accounts.models import LABEL_CHARS, ApiToken
from portal.cluster.models import Node
from portal.errors import ApiError, forbidden


def _serves_another(served: Node, name: str) -> ApiError:
    return forbidden(
        f"this agent token serves node {served.name!r}, not {name!r}; one agent token serves one "
        "node: issue another with manage.py create_token USER --role agent"
    )


def _held_by_another(name: str) -> ApiError:
    return forbidden(f"node {name!r} is registered with another agent token; each node's agent needs its own")


def _check_pool_claim(name: str, pool_token: ApiToken) -> None:
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


def check_claim(name: str, token: ApiToken) -> None:
    """Lets `token` register node `name`, or raises ApiError 403 if another token holds the
    name or `token` already serves another node; for a pool token, if `name` is not of its pool
    or any token holds it. Call it inside the registration's transaction: it locks the token's
    row and the node's, so that registrations with one token, or of one name, take turns."""
    if token.role == ApiToken.Role.POOL:
        _check_pool_claim(name, token)
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
