"""The portal's ASGI server, the same wherever the portal runs (`make demo`, the tests'
platforms, docker-compose.yml): uvicorn, started as `python -m portal.serve --host H --port P
--processes N` (portal.launcher.portal_command builds that line).

uvicorn hands a request to the application as soon as its headers are in and reads its body
only as the application asks for it, so portal.body_limit refuses a body over its limit before
it is read. daphne, which the demo and the tests ran before, reads a whole body (through Twisted,
into a temporary file) before the application sees the request: a lying `Content-Length:
2147483648` got no answer in 20 s while the body streamed to /tmp.

The options, and why (`uvicorn_arguments`):
- `--workers N` only with several processes: N processes answer on one address, the kernel
  handing each connection to one of them;
- `--ws websockets-sansio`: the WebSocket implementation on the `websockets` package that uvicorn
  picks by default since 0.50 (its older `websockets` one is deprecated, with a warning at every
  start);
- `--lifespan off`: Django's ASGI application and Channels' router take no lifespan events
  (with `auto`, every start logs that the protocol "appears unsupported");
- `--no-access-log`: a line per request is noise; errors are logged;
- `--timeout-graceful-shutdown`: on SIGTERM uvicorn stops taking connections, closes the open
  sockets (1012, "service restart": the pages reconnect) and waits for requests in flight at
  most GRACEFUL_SHUTDOWN_S, then cancels them, so that a stop is bounded (docker's own grace is
  10 s);
- forwarded headers (`X-Forwarded-For`, `X-Forwarded-Proto`) are believed only from the
  addresses in BUNGEE_FORWARDED_ALLOW_IPS (PortalSettings.forwarded_allow_ips), the reverse proxy in front of the portal; by default
  from none (`--no-proxy-headers`). uvicorn's own default believes them from 127.0.0.1, where any
  local process could claim to be any client."""

from __future__ import annotations

import argparse

from portal.config import PortalSettings, load_settings

APPLICATION = "portal.asgi:application"
GRACEFUL_SHUTDOWN_S = 5


def uvicorn_arguments(host: str, port: int, processes: int, trusted_proxies: list[str]) -> list[str]:
    """uvicorn's command-line arguments for the portal (this module's docstring says why each)."""
    arguments = [APPLICATION, "--host", host, "--port", str(port)]
    if processes > 1:
        arguments += ["--workers", str(processes)]
    arguments += ["--ws", "websockets-sansio", "--lifespan", "off", "--no-access-log",
                  "--timeout-graceful-shutdown", str(GRACEFUL_SHUTDOWN_S)]
    if trusted_proxies:
        arguments += ["--proxy-headers", "--forwarded-allow-ips", ",".join(trusted_proxies)]
    else:
        arguments += ["--no-proxy-headers"]
    return arguments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m portal.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--processes", type=int, default=1, help="portal processes answering on the one address")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, not {args.processes}")
    # Every setting of the portal is checked here, once, before uvicorn starts its processes: a bad
    # value stops the start with the variable and the value quoted (ImproperlyConfigured).
    trusted = load_settings(PortalSettings).forwarded_allow_ips
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(uvicorn_arguments(args.host, args.port, args.processes, trusted), prog_name="uvicorn")


if __name__ == "__main__":
    main()
