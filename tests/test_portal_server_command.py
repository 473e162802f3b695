"""The portal's server command (portal.serve), pinned: uvicorn with the options its docstring
gives, several processes only when asked for, and forwarded headers believed only from the
addresses in BUNGEE_FORWARDED_ALLOW_IPS (by default from nobody, not uvicorn's 127.0.0.1)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from portal.config import PortalSettings, load_settings
from portal.launcher import portal_command
from portal.serve import main as serve_main
from portal.serve import uvicorn_arguments

COMMON = ["--ws", "websockets-sansio", "--lifespan", "off", "--no-access-log", "--timeout-graceful-shutdown", "5"]


def test_one_process_trusting_no_proxy() -> None:
    assert uvicorn_arguments("127.0.0.1", 8000, 1, []) == [
        "portal.asgi:application", "--host", "127.0.0.1", "--port", "8000", *COMMON, "--no-proxy-headers",
    ]


def test_several_processes_behind_a_proxy() -> None:
    assert uvicorn_arguments("0.0.0.0", 8000, 3, ["10.0.0.5", "10.1.0.0/16"]) == [
        "portal.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--workers", "3", *COMMON,
        "--proxy-headers", "--forwarded-allow-ips", "10.0.0.5,10.1.0.0/16",
    ]


def test_the_launcher_starts_the_server_through_portal_serve() -> None:
    assert portal_command(8123, "127.0.0.2", 2) == [
        "-m", "portal.serve", "--host", "127.0.0.2", "--port", "8123", "--processes", "2",
    ]


@pytest.mark.parametrize(("raw", "trusted"), [
    ("", []), (" ", []), ("10.0.0.5", ["10.0.0.5"]), ("10.0.0.5, 172.16.0.0/12,::1", ["10.0.0.5", "172.16.0.0/12", "::1"]),
    ("*", ["*"]),
])
def test_forwarded_allow_ips_takes_addresses_and_networks(raw: str, trusted: list[str]) -> None:
    assert load_settings(PortalSettings, {"BUNGEE_FORWARDED_ALLOW_IPS": raw}).forwarded_allow_ips == trusted


@pytest.mark.parametrize("raw", ["proxy.internal", "10.0.0.300", "10.0.0.5;10.0.0.6", "/run/proxy.sock"])
def test_a_bad_forwarded_allow_ips_stops_the_start_with_the_value_quoted(raw: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="BUNGEE_FORWARDED_ALLOW_IPS=") as refused:
        load_settings(PortalSettings, {"BUNGEE_FORWARDED_ALLOW_IPS": raw})
    assert repr(raw) in str(refused.value)


def test_the_entry_point_refuses_a_bad_value_before_uvicorn_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn.main

    started: list[list[str]] = []
    monkeypatch.setattr(uvicorn.main, "main", lambda arguments, prog_name: started.append(arguments))
    monkeypatch.setenv("BUNGEE_FORWARDED_ALLOW_IPS", "proxy.internal")
    with pytest.raises(ImproperlyConfigured, match="BUNGEE_FORWARDED_ALLOW_IPS='proxy.internal'"):
        serve_main(["--port", "8123"])
    assert started == []


def test_the_entry_point_reads_the_trusted_proxies_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn.main

    started: list[list[str]] = []
    monkeypatch.setattr(uvicorn.main, "main", lambda arguments, prog_name: started.append(arguments))
    monkeypatch.setenv("BUNGEE_FORWARDED_ALLOW_IPS", "10.0.0.5")
    serve_main(["--port", "8123", "--processes", "2"])
    monkeypatch.delenv("BUNGEE_FORWARDED_ALLOW_IPS")
    serve_main(["--port", "8123"])
    assert started == [uvicorn_arguments("127.0.0.1", 8123, 2, ["10.0.0.5"]), uvicorn_arguments("127.0.0.1", 8123, 1, [])]
