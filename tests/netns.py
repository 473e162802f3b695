"""Separate hosts on one machine: a network namespace per host, each with its own address on a
bridge in the root namespace, where the portal, Redis and PostgreSQL stay. Needs root and
iproute2; `why_not()` says why a machine cannot make them.

    with hosts(["node-a", "node-b"]) as net:
        net.prefix("node-a")    # ["ip", "netns", "exec", NS]: run a command on that host
        net.cut("node-b")       # its link down: nothing reaches it, it reaches nothing
        net.mend("node-b")
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.231.{}"
"""A /24 per network, from a private range nothing on this machine uses."""


def why_not() -> str | None:
    """The reason this process cannot make namespaces, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"bungee-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    namespace: str
    link: str
    """The root namespace's end of the host's veth pair, on the bridge."""
    address: str


@dataclass
class Network:
    bridge: str
    gateway: str
    """The root namespace's address on the bridge: where the portal and Redis listen."""
    hosts: dict[str, Host]

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].namespace]

    def cut(self, name: str) -> None:
        """Takes host `name`'s link down: its packets, both ways, go nowhere."""
        _ip("link", "set", self.hosts[name].link, "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")


@contextmanager
def hosts(names: list[str]) -> Iterator[Network]:
    """Makes a namespace per name (its interface is eth0, its address 10.231.N.2, .3, ...) on a
    fresh bridge at 10.231.N.1, and removes them all on exit."""
    tag = uuid.uuid4().hex[:6]
    # A band of 50 subnets per pytest-xdist worker (up to 4), so two workers never pick one.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    subnet = SUBNET.format(20 + (worker % 4) * 50 + int(tag, 16) % 50)
    bridge = f"bgbr{tag}"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for number in range(len(names)):
            host = Host(f"bungee-{tag}-{number}", f"bgv{tag}{number}", f"{subnet}.{number + 2}")
            _ip("netns", "add", host.namespace)
            made.append(host)
            inner = f"bgi{tag}{number}"
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", host.link, "master", bridge)
            _ip("link", "set", host.link, "up")
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", inner, "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield Network(bridge, f"{subnet}.1", dict(zip(names, made, strict=False)))
    finally:
        for host in made:
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
