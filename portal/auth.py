"""API authentication: a session (browsers; ninja checks CSRF for it) or a bearer token
(scripts use a user token, agents an agent token). A token of another role is refused with 403
naming its role: it is a valid token, just not one for that endpoint. A request with neither a
valid token nor a signed-in session is 401, never a CSRF refusal: CSRF is checked only for the
session that would let the request in.

Which token speaks for a node is decided here, in one place: every agent endpoint takes a node's
own agent token (`agent_auth`), and registration alone (`registration_auth`) also takes a pool
token, which may only register new nodes of its pool (portal.cluster.binding). A pool token
never reports, uploads or fetches: the registration hands the node a token of its own for that."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AnonymousUser, User
from django.http import HttpRequest
from django.utils import timezone
from ninja.security import HttpBearer, SessionAuth

from portal.accounts.models import ApiToken
from portal.errors import ApiError, forbidden

LAST_USED_RESOLUTION = timedelta(minutes=1)

_POOL_TOKEN_REFUSED = (
    "this is a pool token: it only registers new nodes of its pool (POST /api/agent/register); "
    "report, upload and fetch with the node token that registration returned (node_token)"
)


class SignedInRequest(HttpRequest):
    """The type of a request that only a signed-in user reaches: a view behind login_required,
    or an API endpoint behind user_auth. It tells the type checker what they let through: the
    request's user is a User, never AnonymousUser."""

    user: User


class TokenAuth(HttpBearer):
    def __init__(self, *roles: str, refuse_other_roles: bool = False) -> None:
        """Takes a token of any of `roles`. `refuse_other_roles`: a valid token of another role
        gets 403 rather than falling through to the next authenticator (and a 401)."""
        super().__init__()
        self.roles = tuple(str(role) for role in roles)
        self.refuse_other_roles = refuse_other_roles

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        """The token's user, or None (401) for an unknown token. Raises ApiError 403 for a
        token of another role where `refuse_other_roles`."""
        found = ApiToken.lookup(token)
        if found is None:
            return None
        if found.role not in self.roles:
            if self.refuse_other_roles:
                if found.role == ApiToken.Role.POOL:
                    raise forbidden(_POOL_TOKEN_REFUSED)
                wanted = " or ".join(repr(role) for role in self.roles)
                raise forbidden(
                    f"this token's role is {found.role!r}; this endpoint takes a token of role {wanted}"
                )
            return None
        now = timezone.now()
        if found.last_used_at is None or now - found.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=found.pk).update(last_used_at=now)
        request.user = found.user
        request.api_token = found  # type: ignore[attr-defined]
        return found.user


class SignedInSession(SessionAuth):
    """ninja's session authentication, run only for a signed-in session: ninja checks CSRF before
    it looks at the session, so an anonymous request (or one with a token of another role)
    would get 403 "CSRF check Failed" rather than 401."""

    def __call__(self, request: HttpRequest) -> Any:
        if not request.user.is_authenticated:
            return None
        return super().__call__(request)


user_auth = [TokenAuth(ApiToken.Role.USER, refuse_other_roles=True), SignedInSession()]
agent_auth = TokenAuth(ApiToken.Role.AGENT, refuse_other_roles=True)
"""Every agent endpoint but registration: the node's own agent token."""
registration_auth = TokenAuth(ApiToken.Role.AGENT, ApiToken.Role.POOL, refuse_other_roles=True)
"""POST /api/agent/register alone: a node's agent token, or a pool token registering a new node."""


def require_staff(user: User | AnonymousUser, what: str) -> None:
    """Raises ApiError 401 for anonymous users and 403 for users who are not staff; `what` says
    what only staff may do ("see the scheduler's decisions")."""
    if not user.is_authenticated:
        raise ApiError(401, "unauthenticated", "log in or send an API token")
    if not user.is_staff:
        raise forbidden(f"only staff may {what}, and {user.get_username()} is not staff")
