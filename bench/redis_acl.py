"""What Redis ACL users cost a resize: the Redis side of a generation switch, as the default user
(no ACL rules) and as a job's own user (portal.redis_users' rules: its keys only, no listing),
and the one ACL SETUSER a publish adds (the job's user made again).

A switch's Redis traffic is what the membership board protocol sends for one generation with two
members (elastic.membership.redis): the record published and read, two joiners marked ready and
the set read, the go tokens pushed and taken, the store's port announced and taken, two
heartbeats. The two users run it in turn, round after round, against the same Redis, so that both
see the same load. Prints min / median / max per arm and the conditions; the last line is one
JSON object.

    python bench/redis_acl.py                 # 300 rounds
    python bench/redis_acl.py --rounds 1000

Measured on a 2-CPU VM (Redis 7.0.15 on loopback, redis-py 8.1), 1000 rounds: a switch's traffic
min 0.972 / median 1.076 / max 6.68 ms as the default user, 0.966 / 1.070 / 6.16 ms as a job's
user (no difference beyond noise); the ACL SETUSER a publish adds 0.123 / 0.169 / 4.17 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import REDIS_URL  # noqa: E402
from elastic.membership.redis import RedisBoard  # noqa: E402
from elastic.wire import Member, Membership  # noqa: E402
from portal.redis_users import JOB_COMMANDS  # noqa: E402


def switch(board: RedisBoard, generation: int) -> None:
    """The board traffic of one generation switch with two members."""
    members = [Member(node="node-a", device_index=i, address="127.0.0.1", joiner=True) for i in range(2)]
    record = Membership(job_id=1, generation=generation, master_addr="127.0.0.1", master_port=29500,
                        members=members, has_state=True)
    board.publish(record)
    assert board.latest_generation() == generation and board.record(generation) is not None
    for member in members:
        board.mark_ready(generation, member.key)
    assert len(board.ready(generation)) == 2
    board.send_go(generation, 2)
    assert board.wait_go(generation, 1) and board.wait_go(generation, 1)
    board.announce_store(generation, 29501, 1)
    assert board.wait_store(generation, 1) == 29501
    for member in members:
        board.beat(member.key, os.getpid())


def timed(call: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    call(*args)
    return (time.perf_counter() - started) * 1000


def summary(values: list[float]) -> dict[str, float]:
    return {"min_ms": min(values), "median_ms": statistics.median(values), "max_ms": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()

    admin = redis.Redis.from_url(REDIS_URL)
    run = uuid.uuid4().hex[:8]
    key = f"bench-acl-{run}:job:1"
    user, password = key, uuid.uuid4().hex

    def make_user() -> None:
        admin.acl_setuser(user, enabled=True, reset=True, passwords=[f"+{password}"], keys=[f"{key}:*"],
                          channels=[f"{key}:*"], commands=[*JOB_COMMANDS, "-function"])  # Redis 7's rules

    make_user()
    as_default = RedisBoard(redis.Redis.from_url(REDIS_URL), f"{key}-default")
    as_job = RedisBoard(redis.Redis.from_url(REDIS_URL, username=user, password=password), key)
    try:
        for board in (as_default, as_job):  # connections made, scripts loaded
            switch(board, 1)
        times: dict[str, list[float]] = {"default user": [], "job's user": [], "ACL SETUSER": []}
        for generation in range(2, args.rounds + 2):
            times["default user"].append(timed(switch, as_default, generation))
            times["job's user"].append(timed(switch, as_job, generation))
            times["ACL SETUSER"].append(timed(make_user))
    finally:
        for pattern in (f"{key}:*", f"{key}-default:*"):
            for stale in admin.scan_iter(pattern):
                admin.delete(stale)
        admin.acl_deluser(user)
    server = admin.info("server")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; Python "
          f"{platform.python_version()}, redis-py {redis.__version__}, Redis {server['redis_version']} at "
          f"{REDIS_URL.rpartition('@')[2]}; {args.rounds} rounds, the arms in turn")
    results = {name: summary(values) for name, values in times.items()}
    for name, figures in results.items():
        what = "per publish" if name == "ACL SETUSER" else "per switch (15 board calls)"
        print(f"{name:>14} {what}: min {figures['min_ms']:.3f} ms, median {figures['median_ms']:.3f} ms, "
              f"max {figures['max_ms']:.3f} ms")
    added = results["job's user"]["median_ms"] - results["default user"]["median_ms"]
    print(f"a job's user adds {added:+.3f} ms to a switch's Redis traffic (medians); a publish adds one "
          f"ACL SETUSER, {results['ACL SETUSER']['median_ms']:.3f} ms")
    print(json.dumps({"bench": "redis_acl", "rounds": args.rounds, **{
        name.replace("'", "").replace(" ", "_"): figures for name, figures in results.items()}}))


if __name__ == "__main__":
    main()
