"""The CLI's side of the portal: where it is and who is asking (a config file readable only by
its user), and an HTTP client that turns the API's error shape into one exception."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bungee_cli.settings import CliSettings

URL_ENV, TOKEN_ENV = "BUNGEE_URL", "BUNGEE_TOKEN"
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class CliError(Exception):
    """What the user is told, and the exit code (1 for a refusal or failure, 2 for usage)."""

    def __init__(self, message: str, exit_code: int = 1, body: Any = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.body = body


def config_path() -> Path:
    """$BUNGEE_CONFIG, or bungee/config.json under $XDG_CONFIG_HOME (default ~/.config)."""
    return CliSettings().config_path()


@dataclass(frozen=True)
class Login:
    url: str
    token: str

    def save(self) -> Path:
        """Writes the config with mode 0600 (created so: never readable by others, not even for
        a moment), in a directory of mode 0700."""
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            json.dump({"url": self.url, "token": self.token}, out)
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        return path

    @classmethod
    def load(cls) -> Login:
        """$BUNGEE_URL and $BUNGEE_TOKEN, else the saved config. Raises CliError if neither."""
        settings = CliSettings()
        url, token = settings.url, settings.token
        if url and token:
            return cls(url.rstrip("/"), token)
        path = settings.config_path()
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            raise CliError(
                f"not logged in: run `bungee login URL` (or set {URL_ENV} and {TOKEN_ENV})"
            ) from None
        except (OSError, ValueError) as err:
            raise CliError(f"cannot read {path}: {err}") from None
        return cls((url or saved["url"]).rstrip("/"), token or saved["token"])


def describe_error(reply: httpx.Response) -> str:
    """The API's error shape as lines: the message, then what each field adds to it. A field whose
    message the headline already says adds only its value, if the headline lacks that; a value the
    refusal does not have (null: the field was absent) is not shown."""
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}: {reply.text[:300]}"
    message = str(error.get("message") or "refused")
    lines = [f"{message} (HTTP {reply.status_code}, {error.get('code', 'error')})"]
    for field in error.get("fields") or []:
        name, said, value = field.get("field"), str(field.get("message") or ""), field.get("value")
        shown = "" if value is None else repr(value)
        if said and said not in message:
            lines.append(f"  {name}: {said}" + (f" (value: {shown})" if shown else ""))
        elif shown and shown not in message and str(value) not in message:
            lines.append(f"  {name} was {shown}")
    return "\n".join(lines)


PAGE_MAX = 500  # the API's largest page (portal.jobs.api.LIST_PAGE_MAX)


class Portal:
    """The portal's API as the logged-in user. Every method raises CliError for a refusal (4xx,
    with the API's message and fields), a failure (5xx) or an unreachable portal."""

    def __init__(self, login: Login) -> None:
        self.url = login.url
        self.http = httpx.Client(
            base_url=login.url, headers={"Authorization": f"Bearer {login.token}"}, timeout=TIMEOUT
        )

    def token_refused(self) -> str:
        """What to tell a user whose token the portal does not know, and how to get a new one."""
        return (
            f"the portal at {self.url} does not take your API token: it is wrong, or it has expired (an "
            "operator revoked it). Get a new one from an operator (they run `python manage.py create_token "
            f"YOUR_NAME`; `make demo` prints one as it starts), then run `bungee login {self.url}` (or set "
            f"{TOKEN_ENV} to it)"
        )

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._send(method, path, **kwargs).json()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            reply = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise CliError(f"the portal at {self.url} is unreachable: {err}") from None
        return self._checked(reply)

    def listing(self, path: str, limit: int, **params: Any) -> tuple[list[Any], int]:
        """Up to `limit` items of a paged list, following its `Link: rel="next"` pages, and how
        many there are in all (its X-Total-Count)."""
        params = {k: v for k, v in params.items() if v is not None}
        reply = self._send("GET", path, params={**params, "limit": min(limit, PAGE_MAX)})
        items: list[Any] = reply.json()
        total = int(reply.headers.get("X-Total-Count", len(items)))
        while len(items) < limit and "next" in reply.links:
            reply = self._send("GET", reply.links["next"]["url"])
            items.extend(reply.json())
        return items[:limit], total

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    @contextmanager
    def download(self, path: str) -> Iterator[httpx.Response]:
        """A streamed GET, for a file: read it inside the `with`."""
        try:
            with self.http.stream("GET", path) as reply:
                if reply.status_code >= 400:
                    reply.read()
                yield self._checked(reply)
        except httpx.HTTPError as err:
            raise CliError(f"the portal at {self.url} is unreachable: {err}") from None

    def _checked(self, reply: httpx.Response) -> httpx.Response:
        if reply.status_code == 401:
            raise CliError(self.token_refused())
        if reply.status_code >= 400:
            try:
                body = reply.json()
            except ValueError:
                body = None
            raise CliError(describe_error(reply), body=body)
        return reply
