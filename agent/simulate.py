"""Play a device's owner on a simulated node, for demos and tests:

    python -m agent.simulate owner --redis-url URL --node NAME --device N --present
    python -m agent.simulate owner --redis-url URL --node NAME --device N --absent

It XADDs a SimulateOwnerCommand onto the node's command stream, which the node's agent reads
like any other command; on a node with real GPUs the agent logs that it cannot play an owner.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import redis

from agent.commands import COMMAND_FIELD
from elastic.wire import SimulateOwnerCommand, command_stream


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agent.simulate")
    actions = parser.add_subparsers(dest="action", required=True)
    owner = actions.add_parser("owner", help="play the owner of a device arriving or leaving")
    owner.add_argument(
        "--redis-url",
        default=os.environ.get("BUNGEE_AGENT_REDIS_URL") or "redis://127.0.0.1:6379/0",
        help="the Redis that carries the command streams (env BUNGEE_AGENT_REDIS_URL)",
    )
    owner.add_argument("--node", required=True, help="the node's name")
    owner.add_argument("--device", required=True, type=int, help="the device index")
    owner.add_argument(
        "--prefix",
        default=os.environ.get("BUNGEE_REDIS_PREFIX") or "bungee",
        help="the portal's Redis key prefix (env BUNGEE_REDIS_PREFIX; default bungee)",
    )
    presence = owner.add_mutually_exclusive_group(required=True)
    presence.add_argument("--present", dest="present", action="store_true", help="the owner arrives")
    presence.add_argument("--absent", dest="present", action="store_false", help="the owner leaves")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Sends the command; returns 0, or 1 if Redis cannot be reached."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device < 0:
        parser.error(f"--device must be at least 0, got {args.device}")
    command = SimulateOwnerCommand(device_index=args.device, present=args.present)
    stream = command_stream(args.node, args.prefix)
    try:
        with redis.Redis.from_url(args.redis_url, socket_connect_timeout=5) as client:
            entry_id = client.xadd(stream, {COMMAND_FIELD: command.model_dump_json()})
    except redis.RedisError as err:
        print(f"cannot send to {stream} at {args.redis_url}: {err}", file=sys.stderr)
        return 1
    entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    state = "present" if args.present else "absent"
    print(f"{stream} {entry}: owner of device {args.device} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
