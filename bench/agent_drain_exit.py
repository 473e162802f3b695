"""A drained agent's way out: from its last worker's exit to the end of the agent's process.

    python bench/agent_drain_exit.py                 # 5 rounds with standbys off, 5 with them on
    python bench/agent_drain_exit.py --rounds 3 --standbys off

Each round starts a real `python -m agent` (simulated devices, the tests' fake worker) against
the tests' stand-in for the portal's agent API (tests.test_agent_process.FakePortal) and this
machine's Redis, launches one worker, sends the agent SIGTERM (it drains: the worker stays) and
then stops the worker as the portal would once it planned the node out. Timed: the worker's
"exited" event (dated by the agent when it reaps the worker) to the agent's process end, seen by
a poll every 5 ms; also the SIGTERM to the end. This is what an owner's job waits for after its
sbatch, once the job has left the node. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import show, spread  # noqa: E402
from elastic.wire import StopCommand  # noqa: E402
from tests.test_agent_process import TOKEN, AgentProcess, FakePortal, send, worker_launch  # noqa: E402

DEADLINE_S = 180.0
"""Bound on each wait: the fork server's imports took over a minute on a 2-core VM under load 12."""


def wait(condition: object, what: str, timeout_s: float = DEADLINE_S) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()  # type: ignore[operator]
        if found:
            return found
        time.sleep(0.005)
    raise SystemExit(f"timed out waiting for {what}")


def one_round(work: Path, standbys: str) -> tuple[float, float]:
    """Returns (last worker's exit -> agent's end, SIGTERM -> agent's end) in seconds."""
    node = f"bench-exit-{uuid.uuid4().hex[:8]}"
    portal = FakePortal(node)
    agent = AgentProcess(portal.url, node, work / f"{node}.log", TOKEN, "--state-dir", str(work / node),
                         "--standbys", standbys, "--drain-deadline", "60")
    try:
        wait(lambda: portal.reports, "a first report")
        send(node, worker_launch(busy=True, step_s=0.05))
        wait(lambda: portal.reports[-1].running, "a running worker")
        termed = time.time()
        agent.process.send_signal(signal.SIGTERM)
        wait(lambda: portal.reports[-1].drain, "a report with the drain notice")
        send(node, StopCommand(job_id=11, before_generation=2, reason="resize"))
        wait(lambda: agent.process.poll() is not None, "the agent's end")
        ended = time.time()
        if agent.process.returncode != 0:
            raise SystemExit(f"the agent exited {agent.process.returncode}: {agent.stderr()[-2000:]}")
        exits = [e.at for e in portal.events() if e.kind == "exited"]
        return ended - max(exits), ended - termed
    finally:
        agent.kill()
        portal.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--standbys", default="off,on", help="the agents' --standbys, each in turn (default: off,on)")
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bungee-exit-bench-") as name:
        for standbys in args.standbys.split(","):
            after_exit, after_term = [], []
            for _ in range(args.rounds):
                exit_s, term_s = one_round(Path(name), standbys)
                after_exit.append(exit_s)
                after_term.append(term_s)
            print(f"standbys {standbys}: last worker exit -> agent end {show(after_exit)}; "
                  f"SIGTERM -> agent end {show(after_term)}")
            results[f"standbys_{standbys}"] = {"exit_to_end_s": spread(after_exit), "term_to_end_s": spread(after_term)}
    load = os.getloadavg()[0]
    print(f"conditions: {os.cpu_count()} cores, load average (1 min) {load:.2f} at the end, {args.rounds} rounds each")
    print(json.dumps({"load_average_1m": round(load, 2), "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
