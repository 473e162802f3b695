"""What the memory a joiner receives the state into costs: one process sends 205 MB (the 25.6M
model's parameters and momentum) to another over gloo, and the receiver takes it into

- `fresh 4 kB pages`: a new torch.empty each time, as a joiner's optimiser tensors are
  (elastic.worker.transfer.apply_outline: every page is first touched by the receive, inside the
  pause);
- `huge pages`: a new region of transparent huge pages each time (private anonymous mmap,
  madvise HUGEPAGE; the platform received into these from bf39bb9 until the land-time A/B of
  bench/results/land-receive-pages-ab-cpu-2core-amd-2026-11-26.txt withdrew them);
- `touched`: one tensor, filled once before and reused (the wire's speed, as the raw broadcast
  of bench/resize.py measures it).

By default one pair of processes does every repeat (the first of each arm is dropped as a
warm-up). `--new-process` starts a new pair for every receive and keeps it, as a joiner is: a
new process whose first large allocation is that receive; there the huge pages cost what the
benchmark in one process hides.

    python bench/receive_pages.py               # 10 repeats in one pair of processes
    python bench/receive_pages.py --new-process --repeats 5

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import PYTHON_PATH, machine, show, spread  # noqa: E402
from elastic.worker.local import free_port  # noqa: E402

SIZE = 205_028_000
ARMS = ("fresh 4 kB pages", "huge pages", "touched")

_PAIR = """
import json, sys, time, torch, torch.distributed as dist
import ctypes, mmap
from datetime import timedelta
rank, port, size, repeats, warm_up = (int(a) for a in sys.argv[1:6])
arms = sys.argv[6].split(",")
HUGE_PAGE = 2 * 2**20

def huge_pages(count):
    nbytes = count * 4
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).view(torch.float32)

torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
count = size // 4
sent = torch.ones(count)
touched = torch.zeros(count)
times = {arm: [] for arm in arms}
for repeat in range(repeats + warm_up):
    for arm in times:
        into = None
        if rank == 1:
            into = {"fresh 4 kB pages": lambda: torch.empty(count), "huge pages": lambda: huge_pages(count),
                    "touched": lambda: touched}[arm]
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(sent, 1)
        else:
            buffer = into()  # made inside the clock, as at a switch
            dist.recv(buffer, 0)
        dist.barrier()
        if repeat >= warm_up:
            times[arm].append(time.perf_counter() - began)
        buffer = None
if rank == 1:
    print(json.dumps(times))
dist.destroy_process_group()
"""


def run_pair(arms: tuple[str, ...], repeats: int, warm_up: int) -> dict[str, list[float]]:
    """One sender and one receiver process: the receive times of `repeats` rounds of `arms`,
    after `warm_up` rounds not counted."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHON_PATH}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _PAIR, str(rank), str(port), str(SIZE), str(repeats), str(warm_up), ",".join(arms)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise SystemExit(f"the pair failed: exit codes {[p.returncode for p in processes]}")
    times: dict[str, list[float]] = json.loads(outputs[1].strip().splitlines()[-1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-process", action="store_true", help="a new pair of processes for every receive")
    args = parser.parse_args()
    conditions = machine()
    began = time.monotonic()
    if args.new_process:
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:  # alternated, one receive each, counted: the process's first
                times[arm] += run_pair((arm,), 1, 0)[arm]
    else:
        times = run_pair(ARMS, args.repeats, 1)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"conditions: {conditions}; transparent huge pages: {mode.read_text().strip() if mode.exists() else 'absent'}")
    where = "a new pair of processes for each receive" if args.new_process else "one pair of processes"
    print(f"{SIZE / 1e6:.0f} MB over gloo, one sender to one receiver ({where}), received into (min / median / max, GB/s at the median):")
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(f"  {arm:18} {show(times[arm])}  {SIZE / median / 1e9:.2f} GB/s")
    fresh, huge = statistics.median(times[ARMS[0]]), statistics.median(times[ARMS[1]])
    print("per repeat, huge pages: " + " ".join(f"{t:.3f}" for t in times[ARMS[1]]))
    print(f"huge pages take {huge / fresh:.2f}x the time of fresh 4 kB pages; load average {os.getloadavg()[0]:.2f} at the end")
    print(json.dumps({
        "bench": "receive_pages",
        "bytes": SIZE,
        "new_process": args.new_process,
        "seconds": {arm: spread(times[arm]) for arm in ARMS},
        "huge_over_fresh": huge / fresh,
        "conditions": conditions,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }))


if __name__ == "__main__":
    main()
