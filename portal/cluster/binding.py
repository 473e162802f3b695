"""Which agent token speaks for which node. An agent token serves one node: the first
registration with a token claims the node's name for it, and from then on only that token may
register the node again (an agent restart) or report for it. A node no token holds (registered
before tokens were bound, or whose token was deleted) is claimed by the next token that
registers it, which is how an operator rotates a node's token."""

from __future__ import annotations

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from portal.errors import ApiError, forbidden


def _serves_another(served: Node, name: str) -> ApiError:
    return forbidden(
        f"this agent token serves node {served.name!r}, not {name!r}; one agent token serves one "
        "node: issue another with manage.py create_token USER --role agent"
    )


def _held_by_another(name: str) -> ApiError:
    return forbidden(f"node {name!r} is registered with another agent token; each node's agent needs its own")


def check_claim(name: str, token: ApiToken) -> None:
    """Lets `token` register node `name`, or raises ApiError 403 if another token holds the
    name or `token` already serves another node. Call it inside the registration's
    transaction: it locks the token's row and the node's, so that registrations with one token,
    or of one name, take turns."""
    ApiToken.objects.select_for_update().filter(pk=token.pk).first()
    served = Node.objects.filter(agent_token=token).exclude(name=name).first()
    if served is not None:
        raise _serves_another(served, name)
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None and node.agent_token_id not in (None, token.pk):
        raise _held_by_another(name)


def bind(node: Node, token: ApiToken) -> None:
    """Records that `token` serves `node` (a no-op if it already does). Raises ApiError 403 if
    another token claimed the node since check_claim (two new agents racing for one name)."""
    if node.agent_token_id == token.pk:
        return
    if Node.objects.filter(pk=node.pk, agent_token__isnull=True).update(agent_token=token) != 1:
        raise _held_by_another(node.name)
    node.agent_token = token


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
