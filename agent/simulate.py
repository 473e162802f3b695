"""Play a device's owner on a simulated node, for demos and tests:

    python -m agent.simulate owner --redis-url URL --node NAME --device N --present
    python -m agent.simulate owner --redis-url URL --node NAME --device N --absent
    python -m agent.simulate slow --redis-url URL --node NAME --device N --factor 3

It XADDs a SimulateOwnerCommand (or a SimulateSlowdownCommand: workers started on the device
from then on run `factor` times slower) onto the node's command stream, which the node's agent
reads like any other command; on a node with real GPUs the agent logs that it cannot play them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import redis
from pydantic import Field

from agent.commands import COMMAND_FIELD
from elastic.environ_settings import EnvironSettings
from elastic.wire import SimulateOwnerCommand, SimulateSlowdownCommand, command_stream


class SimulateSettings(EnvironSettings):
    """The defaults of `python -m agent.simulate`'s --redis-url and --prefix (field `x_y` is flag
    `--x-y`), read from the variables the node's agent and the portal are given."""

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias="BUNGEE_AGENT_REDIS_URL",
        description="the Redis that carries the command streams",
    )
    prefix: str = Field(
        "bungee", validation_alias="BUNGEE_REDIS_PREFIX", description="the portal's Redis key prefix"
    )


def build_parser() -> argparse.ArgumentParser:
    settings = SimulateSettings.from_environ()
    parser = argparse.ArgumentParser(prog="python -m agent.simulate")
    actions = parser.add_subparsers(dest="action", required=True)
    owner = actions.add_parser("owner", help="play the owner of a device arriving or leaving")
    slow = actions.add_parser("slow", help="play a slow device (for the workers started on it from now on)")
    for sub in (owner, slow):
        for name, field in SimulateSettings.model_fields.items():
            sub.add_argument(
                SimulateSettings.flag(name),
                default=getattr(settings, name),
                help=f"{field.description} (env {SimulateSettings.variable(name)}; default {field.default})",
            )
        sub.add_argument("--node", required=True, help="the node's name")
        sub.add_argument("--device", required=True, type=int, help="the device index")
    presence = owner.add_mutually_exclusive_group(required=True)
    presence.add_argument("--present", dest="present", action="store_true", help="the owner arrives")
    presence.add_argument("--absent", dest="present", action="store_false", help="the owner leaves")
    slow.add_argument("--factor", required=True, type=float, help="how many times slower (1: normal speed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Sends the command; returns 0, or 1 if Redis cannot be reached."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device < 0:
        parser.error(f"--device must be at least 0, got {args.device}")
    command: SimulateOwnerCommand | SimulateSlowdownCommand
    if args.action == "owner":
        command = SimulateOwnerCommand(device_index=args.device, present=args.present)
        what = f"owner of device {args.device} {'present' if args.present else 'absent'}"
    else:
        if not 1.0 <= args.factor <= 100.0:
            parser.error(f"--factor must be between 1 and 100, got {args.factor}")
        command = SimulateSlowdownCommand(device_index=args.device, factor=args.factor)
        what = f"device {args.device} {args.factor:g} times slower"
    stream = command_stream(args.node, args.prefix)
    try:
        with redis.Redis.from_url(args.redis_url, socket_connect_timeout=5) as client:
            entry_id = client.xadd(stream, {COMMAND_FIELD: command.model_dump_json()})
    except redis.RedisError as err:
        print(f"cannot send to {stream} at {args.redis_url}: {err}", file=sys.stderr)
        return 1
    entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    print(f"{stream} {entry}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
