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

URL_ENV, TOKEN_ENV, CONFIG_ENV = "BUNGEE_URL", "BUNGEE_TOKEN", "BUNGEE_CONFIG"
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class CliError(Exception):
    """What the user is told, and the exit code (1 for a refusal or failure, 2 for usage)."""

    def __init__(self, message: str, exit_code: int = 1, body: Any = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.body = body


def config_path() -> Path:
    """$BUNGEE_CONFIG, or bungee/config.json under $XDG_CONFIG_HOME (default ~/.config)."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "bungee" / "config.json"


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
        url, token = os.environ.get(URL_ENV), os.environ.get(TOKEN_ENV)
        if url and token:
            return cls(url.rstrip("/"), token)
        path = config_path()
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
    """The API's error shape as lines: the message, then each field with its value."""
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}: {reply.text[:300]}"
    lines = [f"{error.get('message', 'refused')} (HTTP {reply.status_code}, {error.get('code', 'error')})"]
    for field in error.get("fields") or []:
        lines.append(f"  {field.get('field')}: {field.get('message')} (value: {field.get('value')!r})")
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
        if reply.status_code >= 400:
            try:
                body = reply.json()
            except ValueError:
                body = None
            raise CliError(describe_error(reply), body=body)
        return reply
