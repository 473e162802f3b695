"""What the memory a joiner receives the state into costs: one process sends 205 MB (the 25.6M
model's parameters and momentum) to another over gloo, and the receiver takes it into

- `fresh 4 kB pages`: a new torch.empty each time, as a joiner's optimiser tensors were (the
  baseline: every page is first touched by the receive, inside the pause);
- `huge pages`: a new elastic.worker.transfer.receive_buffer each time (ours: fresh too, on
  transparent huge pages);
- `touched`: one tensor, filled once before and reused (the wire's speed, as the raw broadcast
  of bench/resize.py measures it).

The three alternate, repeated; the first of each is dropped (warm-up).

    python bench/receive_pages.py               # 10 repeats
    python bench/receive_pages.py --repeats 20

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
from datetime import timedelta
from elastic.worker.transfer import receive_buffer
rank, port, size, repeats = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
count = size // 4
sent = torch.ones(count)
touched = torch.zeros(count)
cpu = torch.device("cpu")
times = {"fresh 4 kB pages": [], "huge pages": [], "touched": []}
for repeat in range(repeats + 1):
    for arm in times:
        into = None
        if rank == 1:
            into = {"fresh 4 kB pages": lambda: torch.empty(count), "huge pages": lambda: receive_buffer((count,), torch.float32, cpu),
                    "touched": lambda: touched}[arm]
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(sent, 1)
        else:
            buffer = into()  # made inside the clock, as at a switch
            dist.recv(buffer, 0)
        dist.barrier()
        if repeat:
            times[arm].append(time.perf_counter() - began)
        buffer = None
if rank == 1:
    print(json.dumps(times))
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    conditions = machine()
    began = time.monotonic()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHON_PATH}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _PAIR, str(rank), str(port), str(SIZE), str(args.repeats)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise SystemExit(f"the pair failed: exit codes {[p.returncode for p in processes]}")
    times: dict[str, list[float]] = json.loads(outputs[1].strip().splitlines()[-1])
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"conditions: {conditions}; transparent huge pages: {mode.read_text().strip() if mode.exists() else 'absent'}")
    print(f"{SIZE / 1e6:.0f} MB over gloo, one sender to one receiver, received into (min / median / max, GB/s at the median):")
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(f"  {arm:18} {show(times[arm])}  {SIZE / median / 1e9:.2f} GB/s")
    fresh, huge = statistics.median(times[ARMS[0]]), statistics.median(times[ARMS[1]])
    print("per repeat, huge pages: " + " ".join(f"{t:.3f}" for t in times[ARMS[1]]))
    print(f"huge pages take {huge / fresh:.2f}x the time of fresh 4 kB pages; load average {os.getloadavg()[0]:.2f} at the end")
    print(json.dumps({
        "bench": "receive_pages",
        "bytes": SIZE,
        "seconds": {arm: spread(times[arm]) for arm in ARMS},
        "huge_over_fresh": huge / fresh,
        "conditions": conditions,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }))


if __name__ == "__main__":
    main()
