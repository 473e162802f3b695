"""The agent's side of the portal's agent API: registration and periodic reports, as JSON over
HTTP with the agent token as a bearer token.

Errors say whether to try again: PortalUnavailableError (no answer, a timeout, 408, 429 or a
5xx) is worth retrying; AgentAuthError (401, 403) and PortalRejectedError (any other 4xx) are
not, since the same request would be refused again.

With a pool token, the first registration's reply carries the node's own token: the client
keeps it in the node's state directory (agent.node_token) and speaks with it from then on, and
a client made later on that directory registers with it rather than the pool token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import httpx
from pydantic import ValidationError

from agent.node_token import NODE_TOKEN_FILE, NodeTokenFile
from elastic.wire import AgentReport, NodeRegistration, RegistrationReply

log = logging.getLogger(__name__)

REGISTER_PATH = "/api/agent/register"
REPORT_PATH = "/api/agent/report"
CODE_PATH = "/api/agent/code/{digest}"
ARTIFACTS_PATH = "/api/agent/jobs/{job_id}/artifacts"
INITIAL_MODEL_PATH = "/api/agent/jobs/{job_id}/initial-model"
ARTIFACTS_TIMEOUT_S = 600.0
"""An upload of a job's artifacts may take this long (a large checkpoint)."""
_RETRIABLE_STATUSES = frozenset({408, 429})
_MAX_ERROR_CHARS = 500


class PortalError(Exception):
    """Base of the errors talking to the portal."""


class PortalUnavailableError(PortalError):
    """The portal did not answer, or answered that it cannot serve now; retry later."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status it answered with (5xx, 408, 429), or None if it did not answer."""


class AgentAuthError(PortalError):
    """The portal refused the agent token (401 or 403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class PortalRejectedError(PortalError):
    """The portal refused the request itself (a 4xx other than 401 and 403)."""

    def __init__(self, message: str, status: int, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        """The portal's error code (its `error.code`), where it gave one."""


class PortalClient:
    """One portal at `base_url`. Thread-safe (httpx.Client is). `state_dir`: the node's state
    directory, where the node token a pool token's registration returns is kept
    (agent.node_token); if one is kept there already, the client speaks with it instead of
    `token`."""

    def __init__(
        self,
        base_url: str,
        token: str,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._node_token = NodeTokenFile(state_dir / NODE_TOKEN_FILE) if state_dir is not None else None
        kept = self._node_token.read() if self._node_token is not None else None
        self._speaking_with_node_token = kept is not None
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {kept or token}"},
            timeout=timeout_s,
            transport=transport,
        )

    def register(self, registration: NodeRegistration) -> RegistrationReply:
        """Registers the node; returns the portal's reply, less any node token, which the client
        keeps and speaks with from then on. A node token the portal does not know (401: deleted,
        or its pool token was) is forgotten, and the registration tried once more with the token
        the client was made with, which a pool token may do if the node is free now. Raises
        PortalError (see module)."""
        try:
            reply = self._register(registration)
        except AgentAuthError as err:
            if err.status != 401 or not self._speaking_with_node_token:
                raise
            log.warning(
                "the portal does not know this node's token any more: forgetting it, registering with the "
                "agent's token"
            )
            if self._node_token is not None:
                self._node_token.remove()
            self._use(self._token)
            reply = self._register(registration)
        if reply.node_token is None:
            return reply
        if self._node_token is not None:
            try:
                self._node_token.write(reply.node_token)
            except OSError as err:
                log.error(
                    "could not keep node %r's token in %s (%s): this agent works, but one restarted cannot "
                    "register the node again",
                    registration.name,
                    self._node_token.path,
                    err,
                )
        self._use(reply.node_token)
        return reply.model_copy(update={"node_token": None})

    def _use(self, token: str) -> None:
        self._http.headers["Authorization"] = f"Bearer {token}"
        self._speaking_with_node_token = token != self._token

    def _register(self, registration: NodeRegistration) -> RegistrationReply:
        response = self._post(REGISTER_PATH, registration.model_dump_json())
        try:
            return RegistrationReply.model_validate_json(response.content)
        except ValidationError as err:
            raise PortalRejectedError(
                f"the portal at {self.base_url} answered {REGISTER_PATH} with something that is "
                f"not a registration reply: {err}",
                response.status_code,
                None,
            ) from err

    def report(self, report: AgentReport) -> list[dict[str, Any]]:
        """Sends one report; returns the items the portal refused (each with where it was in
        the report and why), which it did not store. Raises PortalError (see module)."""
        response = self._post(REPORT_PATH, report.model_dump_json())
        try:
            refused = response.json().get("refused", [])
        except (ValueError, AttributeError):
            return []
        return refused if isinstance(refused, list) else []

    def fetch_code(self, digest: str, out: BinaryIO, max_bytes: int) -> None:
        """Writes the archive of the job code `digest` to `out`, as the portal sends it (the
        caller checks the digest). Raises PortalError, also if it is over `max_bytes`."""
        self._download(CODE_PATH.format(digest=digest), out, max_bytes, f"the code {digest}")

    def fetch_initial_model(self, job_id: int, out: BinaryIO, max_bytes: int) -> str:
        """Writes the model job `job_id` starts from (its spec's init_from) to `out`, and
        returns the sha256 the portal holds for it (the caller checks it). Raises PortalError,
        also if it is over `max_bytes`."""
        headers = self._download(
            INITIAL_MODEL_PATH.format(job_id=job_id), out, max_bytes, f"the initial model of job {job_id}"
        )
        return headers.get("X-Bungee-Sha256", "")

    def _download(self, path: str, out: BinaryIO, max_bytes: int, what: str) -> httpx.Headers:
        """Streams GET `path` into `out`; returns the reply's headers. Raises PortalError."""
        try:
            with self._http.stream("GET", path) as response:
                if response.status_code == 403:  # the token is fine: this node runs no such job
                    response.read()
                    code, text = _error_text(response)
                    raise PortalRejectedError(f"portal at {self.base_url} refused GET {path}: {text}", 403, code)
                if response.status_code >= 400:
                    response.read()
                    self._raise_for(response, f"GET {path}")
                received = 0
                for chunk in response.iter_bytes():
                    received += len(chunk)
                    if received > max_bytes:
                        raise PortalRejectedError(f"{what} is over {max_bytes} bytes", 413, "too_large")
                    out.write(chunk)
                return response.headers
        except httpx.TransportError as err:
            raise PortalUnavailableError(
                f"portal at {self.base_url} unreachable ({type(err).__name__}: {err})"
            ) from err

    def upload_artifacts(self, job_id: int, files: dict[str, Path]) -> None:
        """Sends a job's artifacts (name -> file), streamed from disk. Raises PortalError."""
        path = ARTIFACTS_PATH.format(job_id=job_id)
        handles = {name: file.open("rb") for name, file in files.items()}
        try:
            response = self._http.post(
                path,
                files={name: (name, handle, "application/octet-stream") for name, handle in handles.items()},
                timeout=ARTIFACTS_TIMEOUT_S,
            )
        except httpx.TransportError as err:
            raise PortalUnavailableError(
                f"portal at {self.base_url} unreachable ({type(err).__name__}: {err})"
            ) from err
        finally:
            for handle in handles.values():
                handle.close()
        if response.status_code >= 400:
            self._raise_for(response, f"POST {path}")

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: str) -> httpx.Response:
        try:
            response = self._http.post(path, content=body, headers={"Content-Type": "application/json"})
        except httpx.TransportError as err:
            raise PortalUnavailableError(
                f"portal at {self.base_url} unreachable ({type(err).__name__}: {err})"
            ) from err
        if response.status_code < 400:
            return response
        self._raise_for(response, f"POST {path}")

    def _raise_for(self, response: httpx.Response, request: str) -> NoReturn:
        status = response.status_code
        code, text = _error_text(response)
        where = f"portal at {self.base_url} answered {status} to {request}"
        if status in (401, 403):
            raise AgentAuthError(f"{where}: the agent token was refused: {text}", status)
        if status >= 500 or status in _RETRIABLE_STATUSES:
            raise PortalUnavailableError(f"{where}: {text}", status)
        raise PortalRejectedError(f"{where}: {text}", status, code)


def _error_text(response: httpx.Response) -> tuple[str | None, str]:
    """Returns the portal's error code and message: from its error shape
    {"error": {"code", "message"}}, from {"detail": ...}, or the body's text, cut short."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            code = error.get("code")
            return (str(code) if code is not None else None), str(error["message"])
        for key in ("detail", "error", "message"):
            if key in body:
                return None, str(body[key])[:_MAX_ERROR_CHARS]
    text = response.text.strip()[:_MAX_ERROR_CHARS]
    return None, text or response.reason_phrase or "(no body)"
