"""Who may send how big a request body, decided from the request's headers before any of the body
is read (portal.body_limit applies it): the route is resolved and the sender authenticated first,
so that a stranger gets no more than a login form's worth of the portal's memory and disk.

- an agent's artifacts (`POST /api/agent/jobs/N/artifacts`): only a node's agent token, and only
  for a job that has a worker on that node: BUNGEE_ARTIFACT_MAX_BYTES;
- a code upload (`POST /api/code`, the submit page): a user token or a signed-in session:
  BUNGEE_CODE_MAX_BYTES and the multipart form around it;
- any other body: BUNGEE_BODY_MAX_BYTES with a valid token or session, else
  BUNGEE_ANONYMOUS_BODY_MAX_BYTES;
- a body to a path that is no route: 404 before it is read.

The database is read (never written) through asgiref's sync_to_async on Django's own thread, so
that the event loop is not blocked and the queries use the connection Django manages."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, load_backend
from django.db import close_old_connections
from django.http.cookie import parse_cookie
from django.urls import Resolver404, resolve
from django.utils.crypto import constant_time_compare

from elastic.codepack import LEAVE_OUT_ADVICE
from portal.accounts.models import ApiToken
from portal.body_limit import Bound, Refusal, Scope, declared_length
from portal.cluster.models import Node
from portal.jobs.code_api import UPLOAD_OVERHEAD_BYTES
from portal.jobs.models import Job, Worker

ARTIFACTS_PATH = re.compile(r"/api/agent/jobs/(\d+)/artifacts")
CODE_UPLOAD_PATHS = ("/api/code", "/jobs/new/")

_UNAUTHENTICATED = "log in, or send a valid token as 'Authorization: Bearer <token>'"


@dataclass(frozen=True)
class Sender:
    """Who sends a request, as its headers say: a valid token (`token`), a signed-in session
    (`session_user`), or nobody (`bearer_sent` tells an invalid token from none)."""

    token: ApiToken | None = None
    session_user: bool = False
    bearer_sent: bool = False

    @property
    def authenticated(self) -> bool:
        return self.token is not None or self.session_user


def _header(scope: Scope, wanted: bytes) -> str | None:
    value = next((value for name, value in scope.get("headers", []) if name == wanted), None)
    return value.decode("latin1") if value is not None else None


def _bearer(scope: Scope) -> str | None:
    """The bearer token of the Authorization header, as ninja's HttpBearer reads it."""
    header = _header(scope, b"authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _sender(scope: Scope) -> Sender:
    """Reads the token or the session the request names (database and session store, read only)."""
    bearer = _bearer(scope)
    if bearer is not None:
        return Sender(token=ApiToken.lookup(bearer), bearer_sent=True)
    cookie = _header(scope, b"cookie")
    session_key = parse_cookie(cookie).get(settings.SESSION_COOKIE_NAME) if cookie else None
    if not session_key:
        return Sender()
    return Sender(session_user=_signed_in(session_key))


def _signed_in(session_key: str) -> bool:
    """Whether the session is a signed-in user's, checked as django.contrib.auth.get_user checks
    it (its backend, an active user, the password hash the session was made with) but read only:
    get_user flushes a session that fails, and Django does that itself once it runs the request."""
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user_id, backend_path = session.get(SESSION_KEY), session.get(BACKEND_SESSION_KEY)
    if user_id is None or backend_path not in settings.AUTHENTICATION_BACKENDS:
        return False
    user = load_backend(backend_path).get_user(user_id)
    session_hash = session.get(HASH_SESSION_KEY)
    if user is None or not session_hash:
        return False
    hashes = [user.get_session_auth_hash(), *user.get_session_auth_fallback_hash()]
    return any(constant_time_compare(session_hash, known) for known in hashes)


def _unauthenticated(sender: Sender) -> Refusal:
    said = "the bearer token is not valid" if sender.bearer_sent else "no token or session was sent"
    return Refusal(401, "unauthenticated", f"{said}: {_UNAUTHENTICATED}")


def _artifacts(scope: Scope, job_id: int) -> Bound | Refusal:
    """An agent's artifacts: a bound only for the agent token of a node the job has a worker on."""
    sender = _sender(scope)
    if sender.token is None:
        return _unauthenticated(sender)
    if sender.token.role != ApiToken.Role.AGENT:
        return Refusal(403, "forbidden", f"this token's role is {sender.token.role!r}; a job's artifacts come only "
                       "with the agent token of a node the job ran on")
    node = Node.objects.filter(agent_token=sender.token).first()
    if node is None:
        return Refusal(403, "forbidden", "this agent token has registered no node yet")
    if not Job.objects.filter(pk=job_id).exists():
        return Refusal(404, "not_found", f"job {job_id} does not exist")
    if not Worker.objects.filter(job_id=job_id, node=node).exists():
        return Refusal(403, "forbidden", f"job {job_id} never ran on node {node.name!r}")
    return _bound(settings.BUNGEE.artifact_max_bytes, "BUNGEE_ARTIFACT_MAX_BYTES")


def _code_upload(scope: Scope) -> Bound | Refusal:
    sender = _sender(scope)
    if not sender.authenticated:
        return _unauthenticated(sender)
    if sender.token is not None and sender.token.role != ApiToken.Role.USER:
        return Refusal(403, "forbidden", f"this token's role is {sender.token.role!r}; code is uploaded with a "
                       "user token or a signed-in session")
    code = settings.BUNGEE.code_max_bytes
    return _bound(
        code + UPLOAD_OVERHEAD_BYTES,
        f"code of at most BUNGEE_CODE_MAX_BYTES={code} bytes, and {UPLOAD_OVERHEAD_BYTES} for the multipart form around it",
        LEAVE_OUT_ADVICE,
        "the code upload",
    )


def _other(scope: Scope) -> Bound:
    if _sender(scope).authenticated:
        return _bound(settings.BUNGEE.body_max_bytes, "BUNGEE_BODY_MAX_BYTES")
    return _anonymous()


def _anonymous() -> Bound:
    return _bound(
        settings.BUNGEE.anonymous_body_max_bytes, "BUNGEE_ANONYMOUS_BODY_MAX_BYTES, with no valid token or session",
    )


def _bound(limit: int, setting: str, advice: str = "", subject: str = "the request body") -> Bound:
    return Bound(
        limit, setting, advice, settings.BUNGEE.body_timeout_s, settings.BUNGEE.body_min_rate_bytes_s, subject
    )


def _sends_body(scope: Scope) -> bool:
    declared = declared_length(scope)
    chunked = "chunked" in (_header(scope, b"transfer-encoding") or "").lower()
    return chunked or bool(declared)


def _reading(look_up: Callable[..., Bound | Refusal], *args: object) -> Bound | Refusal:
    """Runs `look_up` as Django runs a request: connections past their age, or broken, are
    closed (given back to the pool) before and after, since this runs outside any request."""
    close_old_connections()
    try:
        return look_up(*args)
    finally:
        close_old_connections()


async def _looked_up(look_up: Callable[..., Bound | Refusal], *args: object) -> Bound | Refusal:
    return await sync_to_async(_reading, thread_sensitive=True)(look_up, *args)


async def decide(scope: Scope) -> Bound | Refusal:
    """The bound of the request's body, or its refusal (401, 403, 404) before any of it is read.
    A request with no body, or one that declares no more than an anonymous one may send to a
    route that is no upload, is not looked up in the database."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):  # as Django's ASGIHandler takes the path it routes
        path = path[len(root):]
    if not _sends_body(scope):
        return _anonymous()
    try:
        resolve(path)
    except Resolver404:
        return Refusal(404, "not_found", f"no route {path!r}: nothing here takes a body")
    artifacts = ARTIFACTS_PATH.fullmatch(path)
    if artifacts is not None:
        return await _looked_up(_artifacts, scope, int(artifacts.group(1)))
    if path in CODE_UPLOAD_PATHS:
        return await _looked_up(_code_upload, scope)
    declared = declared_length(scope)
    if declared is not None and declared <= settings.BUNGEE.anonymous_body_max_bytes:
        return _anonymous()
    return await _looked_up(_other, scope)
