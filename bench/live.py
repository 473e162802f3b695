"""Live-update latency: how long a device sample takes from being taken on the node to arriving
in every open browser socket, and what it costs the portal.

One run, side by side on the same platform: (1) ours, the Channels push to N sockets; (2) the
baseline dashboards without push use, N clients polling GET /api/cluster once a second (delay
= age of the newest sample when the poll returns). The simulated backend plays D devices sampled
every second. Prints min/p50/p95/max per approach and the portal's CPU use; the last line is one
JSON object.

    python bench/live.py [--devices 256] [--sockets 20] [--seconds 30] [--quick]

`--burst`: how far the boards fall behind a burst of submissions. N jobs submitted in T s (each
needs more devices than the one agent has, so every job waits in the queue and each new one
moves every queued one's place), S board sockets; per (socket, job) the delay from the job's
201 to the first socket message carrying it, min/p50/p95/max, the messages each socket was
sent that carried job states, and the CPU the portal and the Celery worker used. Side by side in one run: a platform
with BUNGEE_LIVE_COALESCE off (a message per job change, each written to every socket as it
comes: the code before) and one with it on, `--repeats` bursts each (the jobs cancelled and the
platform settled between). After each burst every socket must end showing exactly what a fresh
socket's snapshot shows of every job (`converged`).

    python bench/live.py --burst [--jobs 200] [--over 10] [--sockets 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.platform import Platform, running_platform  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min_ms": round(min(values) * 1000, 1),
        "p50_ms": round(statistics.median(values) * 1000, 1),
        "p95_ms": round(percentile(values, 95) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


async def sockets(platform: Platform, count: int, seconds: float, devices: int,
                  ticks: dict[float, list[float]] | None = None,
                  connecting: list[float] | None = None) -> list[float]:
    """Per (socket, sample): arrival time minus the time the agent took the sample, over
    `seconds` from the moment every socket is open and has had its snapshot. The samples that
    arrive before (50 sockets opening in the same second, each sent the whole cluster) go to
    `connecting`: a burst of its own, reported on its own. `ticks`, if given, gathers per report
    (keyed by its taken_at) each socket's delay for it: the first socket's says what the path
    costs, the spread to the last what the fan-out does."""
    from websockets.asyncio.client import connect

    delays: list[float] = []
    url = platform.base_url.replace("http", "ws") + "/ws/live/"
    headers = {"Authorization": f"Bearer {platform.tokens['alice']}"}
    ready = asyncio.Barrier(count + 1)
    deadline = time.time() + 3600.0

    async def one() -> None:
        async with connect(url, additional_headers=headers, origin="http://127.0.0.1", max_size=2**24) as ws:  # type: ignore[arg-type]
            json.loads(await asyncio.wait_for(ws.recv(), timeout=60))  # the snapshot
            waiting = asyncio.ensure_future(ready.wait())
            while time.time() < deadline:
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.time()))
                except TimeoutError:
                    break
                arrived = time.time()
                message = json.loads(raw)
                if message.get("type") == "samples":
                    # A row without taken_at was taken when its message says (portal.live.samples).
                    taken = [s.get("taken_at", message.get("taken_at")) for s in message["samples"]]
                    if not waiting.done():
                        if connecting is not None:
                            connecting.extend(arrived - t for t in taken)
                        continue
                    delays.extend(arrived - t for t in taken)
                    if ticks is not None and taken:
                        ticks.setdefault(max(taken), []).append(arrived - max(taken))

    async def start() -> None:
        nonlocal deadline
        await asyncio.wait_for(ready.wait(), timeout=120)
        deadline = time.time() + seconds

    await asyncio.gather(start(), *(one() for _ in range(count)))
    return delays


async def polling(platform: Platform, count: int, seconds: float) -> list[float]:
    """Per (client, poll, device): when the poll returned minus when its newest sample was taken."""
    delays: list[float] = []
    deadline = time.time() + seconds
    headers = {"Authorization": f"Bearer {platform.tokens['alice']}"}

    async def one(offset: float) -> None:
        async with httpx.AsyncClient(base_url=platform.base_url, headers=headers, timeout=30) as client:
            await asyncio.sleep(offset)
            while time.time() < deadline:
                started = time.time()
                reply = await client.get("/api/cluster")
                arrived = time.time()
                for node in reply.json()["nodes"]:
                    delays.extend(arrived - d["sample"]["taken_at"] for d in node["devices"] if d["sample"])
                await asyncio.sleep(max(0.0, 1.0 - (time.time() - started)))

    await asyncio.gather(*(one(i / count) for i in range(count)))
    return delays


def portal_processes(platform: Platform) -> list[psutil.Process]:
    """The portal's process and its children (uvicorn's workers)."""
    portal = psutil.Process(next(p for p in platform.group.processes if p.name == "portal").process.pid)
    return [portal, *portal.children(recursive=True)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def settle(platform: Platform, busy_pct: float = 30.0, timeout_s: float = 60.0) -> float:
    """Waits until the portal's processes use under `busy_pct` of a core over a second: polling
    at p50 10 s leaves requests queued in the portal when its clients stop, and they were served
    during the next push phase. Returns the seconds waited."""
    processes = portal_processes(platform)
    started = time.time()
    while time.time() - started < timeout_s:
        before = cpu_seconds(processes)
        time.sleep(1.0)
        if 100 * (cpu_seconds(processes) - before) < busy_pct:
            break
    return time.time() - started


def measure(platform: Platform, run: object) -> tuple[list[float], float]:
    """The delays `run` saw, and the CPU the portal's processes used meanwhile, in percent of
    one core (over 100 with several processes)."""
    processes = portal_processes(platform)
    before = cpu_seconds(processes)
    started = time.time()
    delays = asyncio.run(run)  # type: ignore[arg-type]
    wall = time.time() - started
    return delays, 100 * (cpu_seconds(processes) - before) / wall


BURST_DEVICES = 4
WAITING_SPEC = {"name": "burst", "workload": "digits-mlp", "min_workers": BURST_DEVICES + 1,
                "max_workers": BURST_DEVICES + 1, "steps": 50}
"""A job that waits in the queue of the burst's one agent for as long as it is not cancelled."""


def job_states(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The job summaries a board message carries: one in `job`, several in `jobs`."""
    if message.get("type") == "job":
        return [message["job"]]
    if message.get("type") == "jobs":
        return list(message["jobs"])
    return []


async def burst(platform: Platform, jobs: int, over_s: float, sockets: int) -> dict[str, Any]:
    """One burst: `jobs` submissions spread over `over_s` with `sockets` board sockets open.
    Returns the delays, the messages per socket and whether every socket converged."""
    from websockets.asyncio.client import connect

    url = platform.base_url.replace("http", "ws") + "/ws/live/"
    headers = {"Authorization": f"Bearer {platform.tokens['alice']}"}
    first_seen: list[dict[int, float]] = [{} for _ in range(sockets)]
    newest: list[dict[int, dict[str, Any]]] = [{} for _ in range(sockets)]
    counts = [0] * sockets
    created: dict[int, float] = {}
    refused: list[str] = []
    ready = asyncio.Barrier(sockets + 1)
    done = asyncio.Event()

    async def board(index: int) -> None:
        # No keepalive pings: a portal that is behind answers them late, and the client closed
        # the socket in the middle of the burst.
        async with connect(url, additional_headers=headers, origin="http://127.0.0.1", max_size=2**26,  # type: ignore[arg-type]
                           ping_interval=None) as ws:
            snapshot = json.loads(await asyncio.wait_for(ws.recv(), timeout=60))
            newest[index].update({job["id"]: job for job in snapshot["cluster"]["jobs"]})
            await ready.wait()
            while not done.is_set():
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
                except TimeoutError:
                    continue
                arrived = time.time()
                states = job_states(json.loads(raw))
                counts[index] += bool(states)
                for job in states:
                    first_seen[index].setdefault(job["id"], arrived)
                    newest[index][job["id"]] = job

    async def submit(client: httpx.AsyncClient, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.time()))
        reply = await client.post("/api/jobs", json=WAITING_SPEC)
        answered = time.time()
        if reply.status_code != 201:  # a portal that is behind answers 503 (its database pool waited too long)
            refused.append(f"{reply.status_code} {reply.text[:200]}")
            return
        created[reply.json()["id"]] = answered

    async def run() -> None:
        boards = [asyncio.ensure_future(board(i)) for i in range(sockets)]
        await asyncio.wait_for(ready.wait(), timeout=120)
        start = time.time()
        async with httpx.AsyncClient(base_url=platform.base_url, timeout=120, limits=httpx.Limits(max_connections=jobs),
                                     headers={"Authorization": f"Bearer {platform.tokens['alice']}"}) as client:
            await asyncio.gather(*(submit(client, start + i * over_s / jobs) for i in range(jobs)))
        # Every socket has had every job, and then no job state for 3 s: what they show is final.
        deadline = time.time() + 300
        while time.time() < deadline and not all(set(created) <= set(seen) for seen in first_seen):
            await asyncio.sleep(0.2)
        quiet = -1
        while time.time() < deadline and quiet != sum(counts):
            quiet = sum(counts)
            await asyncio.sleep(3)
        done.set()
        await asyncio.gather(*boards)

    cpu_of = {name: [p for p in platform.group.processes if p.name == name][0].process.pid for name in ("portal", "worker")}
    processes = {name: [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)] for name, pid in cpu_of.items()}
    before = {name: cpu_seconds(ps) for name, ps in processes.items()}
    started = time.time()
    await run()
    wall = time.time() - started
    cpu = {name: round(100 * (cpu_seconds(ps) - before[name]) / wall, 1) for name, ps in processes.items()}

    async with connect(url, additional_headers=headers, origin="http://127.0.0.1", max_size=2**26) as ws:  # type: ignore[arg-type]
        truth = {job["id"]: job for job in json.loads(await asyncio.wait_for(ws.recv(), timeout=60))["cluster"]["jobs"]}
    converged = sum(all(shown.get(job_id) == job for job_id, job in truth.items()) for shown in newest)
    delays = [seen[job_id] - at for seen in first_seen for job_id, at in created.items() if job_id in seen]
    missing = sum(job_id not in seen for seen in first_seen for job_id in created)
    return {"delays": delays, "missing": missing, "messages_per_socket": statistics.median(counts),
            "converged": converged, "cpu_pct": cpu, "job_ids": sorted(created), "refused": refused}


def has_devices(platform: Platform, count: int) -> bool:
    return sum(len(n["devices"]) for n in platform.api("alice").get("/api/cluster").json()["nodes"]) == count


def cancel_all(platform: Platform, job_ids: list[int]) -> None:
    api = platform.api("alice")
    for job_id in job_ids:
        api.post(f"/api/jobs/{job_id}/cancel")
    platform.wait_for("the jobs cancelled", lambda: not api.get("/api/jobs", params={"state": "queued"}).json(), timeout_s=120)


def burst_main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    modes = (("before: a message per job change", "false"), ("coalesced (ours)", "true"))
    for mode, coalesce in [m for m in modes if args.only is None or m[1] == {"before": "false", "coalesced": "true"}[args.only]]:
        delays: list[float] = []
        p95s: list[float] = []
        per_socket: list[float] = []
        converged: list[int] = []
        missing = 0
        cpu: list[dict[str, float]] = []
        with tempfile.TemporaryDirectory() as tmp, running_platform(
                Path(tmp), {"bench-node": BURST_DEVICES}, {"BUNGEE_STANDBYS": "off", "BUNGEE_LIVE_COALESCE": coalesce}) as platform:
            platform.wait_for("the devices", partial(has_devices, platform, BURST_DEVICES), timeout_s=90)
            for repeat in range(args.repeats):
                outcome = asyncio.run(burst(platform, args.jobs, args.over, args.sockets))
                delays += outcome["delays"]
                p95s.append(percentile(outcome["delays"], 95) * 1000)
                per_socket.append(outcome["messages_per_socket"])
                converged.append(outcome["converged"])
                missing += outcome["missing"]
                cpu.append(outcome["cpu_pct"])
                print(f"{mode}, repeat {repeat + 1}: p50 {statistics.median(outcome['delays']) * 1000:.0f} ms, "
                      f"p95 {p95s[-1]:.0f} ms, max {max(outcome['delays']) * 1000:.0f} ms; "
                      f"{outcome['messages_per_socket']:.0f} job messages per socket; {outcome['converged']} of "
                      f"{args.sockets} sockets converged; CPU {outcome['cpu_pct']}; "
                      f"{len(outcome['refused'])} submissions refused {outcome['refused'][:1]}", flush=True)
                cancel_all(platform, outcome["job_ids"])
                print(f"{mode}, repeat {repeat + 1}: the jobs cancelled; the portal settled in {settle(platform):.0f} s", flush=True)
        results[mode] = {**summary(delays), "p95_per_repeat_ms": [round(p, 1) for p in p95s],
                         "messages_per_socket": per_socket, "converged_sockets": converged, "missing": missing,
                         "portal_cpu_pct": [c["portal"] for c in cpu], "celery_cpu_pct": [c["worker"] for c in cpu]}
    load_after = os.getloadavg()
    conditions = (
        f"{host.node()}: {psutil.cpu_count()} cores, Python {host.python_version()}; {args.jobs} submissions in "
        f"{args.over:.0f} s, each waiting in the queue of one agent's {BURST_DEVICES} simulated devices; {args.sockets} "
        f"board sockets; {args.repeats} bursts per mode; one uvicorn process; Redis and PostgreSQL on the same machine; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(f"\nconditions: {conditions}")
    print(f"{'mode':<36} {'n':>7} {'min':>8} {'p50':>8} {'p95':>8} {'max':>8}  job messages/socket  converged")
    for mode, r in results.items():
        print(f"{mode:<36} {r['n']:>7} {r['min_ms']:>6.0f}ms {r['p50_ms']:>6.0f}ms {r['p95_ms']:>6.0f}ms {r['max_ms']:>6.0f}ms"
              f"  {r['messages_per_socket']}  {r['converged_sockets']} of {args.sockets}")
    print(json.dumps({"bench": "live-burst", "jobs": args.jobs, "over_s": args.over, "sockets": args.sockets,
                      "repeats": args.repeats, "before": results.get("before: a message per job change"),
                      "coalesced": results.get("coalesced (ours)"),
                      "load_average": [round(load_before[0], 2), round(load_after[0], 2)]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--sockets", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10 s per phase, one repeat")
    parser.add_argument("--no-polling", action="store_true", help="measure the push alone")
    parser.add_argument("--portals", type=int, default=1, help="portal processes on the one address (uvicorn's workers when > 1)")
    parser.add_argument("--burst", action="store_true", help="the boards during a burst of submissions (the docstring)")
    parser.add_argument("--jobs", type=int, default=200, help="--burst: submissions")
    parser.add_argument("--over", type=float, default=10, help="--burst: seconds the submissions are spread over")
    parser.add_argument("--only", choices=("before", "coalesced"), help="--burst: one mode alone")
    args = parser.parse_args()
    if args.burst:
        burst_main(args)
        return
    if args.quick:
        args.seconds, args.repeats = 10, 1

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, running_platform(
            # No warm standbys: no job runs here, and the agent's starting them (torch imported
            # in each, one after another) took a core during the first half minute of a run.
            Path(tmp), {"bench-node": args.devices}, {"BUNGEE_STANDBYS": "off"}, portal_processes=args.portals) as platform:
        api = platform.api("alice")
        platform.wait_for("the devices", lambda: sum(len(n["devices"]) for n in api.get("/api/cluster").json()["nodes"]) == args.devices, timeout_s=90)
        platform.wait_for("samples", lambda: all(d["sample"] for n in api.get("/api/cluster").json()["nodes"] for d in n["devices"]), timeout_s=60)
        push: list[float] = []
        poll: list[float] = []
        push_cpu: list[float] = []
        push_p95: list[float] = []
        ticks: dict[float, list[float]] = {}
        connecting: list[float] = []
        poll_cpu: list[float] = []
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}: push", flush=True)
            delays, cpu = measure(platform, sockets(platform, args.sockets, args.seconds, args.devices, ticks, connecting))
            push += delays
            push_cpu.append(cpu)
            push_p95.append(percentile(delays, 95) * 1000)
            print(f"repeat {repeat + 1}: push p50 {statistics.median(push) * 1000:.0f} ms", flush=True)
            if not args.no_polling:
                delays, cpu = measure(platform, polling(platform, args.sockets, args.seconds))
                poll += delays
                poll_cpu.append(cpu)
                print(f"repeat {repeat + 1}: poll p50 {statistics.median(poll) * 1000:.0f} ms; "
                      f"the portal settled in {settle(platform):.0f} s", flush=True)

    load_after = os.getloadavg()
    conditions = (
        f"{host.node()}: {psutil.cpu_count()} cores, Python {host.python_version()}; {args.devices} simulated "
        f"devices sampled every 1 s by one agent (no standbys); {args.sockets} clients; {args.repeats} x {args.seconds:.0f} s per "
        f"approach, interleaved; portal = {'one uvicorn process' if args.portals == 1 else f'{args.portals} uvicorn worker processes'}; Redis and PostgreSQL on the same machine; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    ours = summary(push)
    baseline = summary(poll) if poll else None
    print(f"\nconditions: {conditions}")
    print(f"{'approach':<34} {'n':>8} {'min':>8} {'p50':>8} {'p95':>8} {'max':>8}  portal CPU")
    rows = [("Channels push (ours)", ours, push_cpu)] + ([("HTTP polling 1/s (baseline)", baseline, poll_cpu)] if baseline else [])
    for name, s, cpu in rows:
        print(f"{name:<34} {s['n']:>8} {s['min_ms']:>6.0f}ms {s['p50_ms']:>6.0f}ms {s['p95_ms']:>6.0f}ms {s['max_ms']:>6.0f}ms"
              f"  {statistics.median(cpu):.0f}% (min {min(cpu):.0f}, max {max(cpu):.0f})")
    print(f"push p95 per repeat: min {min(push_p95):.0f} ms, median {statistics.median(push_p95):.0f} ms, max {max(push_p95):.0f} ms")
    burst = summary(connecting) if connecting else None
    if burst:
        print(f"while the {args.sockets} sockets were opening (before the measured window): n {burst['n']}, "
              f"p50 {burst['p50_ms']:.0f} ms, p95 {burst['p95_ms']:.0f} ms, max {burst['max_ms']:.0f} ms")
    # Per report that reached every socket: the first socket's delay (agent, portal ingest, layer)
    # and how much later the last socket had it (the fan-out and the client's own parsing).
    whole = [d for d in ticks.values() if len(d) == args.sockets]
    first = summary([min(d) for d in whole]) if whole else None
    spread = summary([max(d) - min(d) for d in whole]) if whole else None
    if first and spread:
        print(f"per report ({first['n']} that reached all {args.sockets} sockets): first socket p50 {first['p50_ms']:.0f} ms, "
              f"p95 {first['p95_ms']:.0f} ms, max {first['max_ms']:.0f} ms; last minus first p50 {spread['p50_ms']:.0f} ms, "
              f"p95 {spread['p95_ms']:.0f} ms, max {spread['max_ms']:.0f} ms")
    print(json.dumps({
        "bench": "live", "devices": args.devices, "sockets": args.sockets, "portals": args.portals,
        "p50_ms": ours["p50_ms"], "p95_ms": ours["p95_ms"], "max_ms": ours["max_ms"], "min_ms": ours["min_ms"],
        "portal_cpu_pct": round(statistics.median(push_cpu), 1),
        "first_socket_ms": first, "last_minus_first_ms": spread, "while_opening_ms": burst,
        "p95_per_repeat_ms": [round(p, 1) for p in push_p95],
        "baseline_polling": {**baseline, "portal_cpu_pct": round(statistics.median(poll_cpu), 1)} if baseline else None,
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)],
        "seconds": args.seconds, "repeats": args.repeats
    }))


if __name__ == "__main__":
    main()
