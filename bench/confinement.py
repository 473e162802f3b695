"""What confining a job costs (elastic.worker.confine, agent.isolation), against the same job not
confined, side by side in one run:

- a cold start and a warm-standby grow: the land time of a scale-out (request to the end of the
  new generation's first step, bench/land.py: the whole platform, one agent, 4 simulated devices,
  the 25.6M digits MLP) with the agent's --isolation uid against none, warm standbys (prepared for
  the job) and no standbys;
- the confinement itself: a process confining itself (what a forked worker or a standby pays when
  it takes a job), and a cold start of the worker's interpreter through the confining wrapper
  (`python -I -S confine.py -- python ...`) against the interpreter alone, each to `import torch`;
- a training step: the same steps of a small MLP in a confined process and in one that is not
  (nothing of the confinement is on the step's path; this says whether that holds).

Needs root (uid confinement). The arms alternate within each round. Last line: one JSON object.

    python bench/confinement.py            # 3 rounds of land times, 10 of the rest
    python bench/confinement.py --quick    # 1 round of land times, 5 of the rest
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.isolation import JOB_UID_COUNT, JobIsolation, interpreter_paths  # noqa: E402
from bench.conditions import PYTHON_PATH, RESNET50_SIZED, ROOT, machine, show, spread  # noqa: E402
from bench.land import SCALE_OUT_1_2, SCALE_OUT_2_3, run_land  # noqa: E402
from elastic.worker import confine as confine_module  # noqa: E402
from elastic.worker.confine import CONFINEMENT_ENV  # noqa: E402

IMPORT_TORCH = "import time; began = time.monotonic(); import torch; print(time.monotonic(), flush=True)"
CONFINE_IN_PROCESS = (
    "import sys, time, os; from elastic.worker.confine import confine_from_env; import torch; "
    "began = time.monotonic(); confine_from_env(); print(time.monotonic() - began)"
)
STEPS = """
import time, torch
torch.manual_seed(0); torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
def step():
    optimizer.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); optimizer.step()
for _ in range(20): step()
began = time.perf_counter()
for _ in range(200): step()
print((time.perf_counter() - began) / 200)
"""


def confined_env(work: Path, job_id: int) -> dict[str, str]:
    """A worker's environment with job `job_id`'s confinement, as the agent makes it."""
    isolation = JobIsolation(400_000, JOB_UID_COUNT, (str(work / "state"),))
    reach = {*interpreter_paths(sys.executable), str(ROOT)}
    confinement = isolation.confinement(job_id, work / "state", str(work / "runs" / f"job-{job_id}-bench"), reach)
    return {**os.environ, "PYTHONPATH": PYTHON_PATH, "OMP_NUM_THREADS": "1", CONFINEMENT_ENV: confinement.to_json()}


def run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def process_costs(rounds: int, work: Path) -> dict[str, dict[str, float | None]]:
    """Seconds: a cold start to `import torch` done, plain and through the wrapper; a confinement
    in process; a step of the MLP, plain and confined."""
    plain_env = {**os.environ, "PYTHONPATH": PYTHON_PATH, "OMP_NUM_THREADS": "1"}
    wrapper = [sys.executable, "-I", "-S", str(confine_module.__file__), "--"]
    found: dict[str, list[float]] = {"cold_start_plain": [], "cold_start_confined": [], "confine_in_process": [],
                                     "step_plain": [], "step_confined": []}
    for round_index in range(rounds):
        env = confined_env(work, 1000 + round_index)
        began = time.monotonic()
        found["cold_start_plain"].append(float(run([sys.executable, "-c", IMPORT_TORCH], plain_env)) - began)
        began = time.monotonic()
        found["cold_start_confined"].append(float(run([*wrapper, sys.executable, "-c", IMPORT_TORCH], env)) - began)
        found["confine_in_process"].append(float(run([sys.executable, "-c", CONFINE_IN_PROCESS], env)))
        found["step_plain"].append(float(run([sys.executable, "-c", STEPS], plain_env)))
        found["step_confined"].append(float(run([*wrapper, sys.executable, "-c", STEPS], env)))
    return {name: spread(values) for name, values in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of land times, 5 of the rest")
    parser.add_argument("--skip-land", action="store_true", help="only the process-level costs")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/confinement.py needs root: jobs are confined to a uid of their own", file=sys.stderr)
        return 2
    began = time.monotonic()
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-confinement-", dir="/var/tmp"))
    work.chmod(0o755)
    processes = process_costs(5 if args.quick else 10, work)
    print("Per process (s), min / median / max:")
    for name, values in processes.items():
        print(f"  {name:22} {values}")
    land: dict[str, dict[str, dict[str, float | None]]] = {}
    if not args.skip_land:
        rounds = 1 if args.quick else 3
        for arm in ("standbys", "cold"):
            for isolation in ("none", "uid"):  # side by side, the baseline first
                times, _ = run_land(RESNET50_SIZED, arm, rounds, work / "land", isolation)
                scale_out = [v for s in (SCALE_OUT_1_2, SCALE_OUT_2_3) for v in times.land_s[s]]
                land.setdefault(arm, {})[isolation] = spread(scale_out)
                print(f"  land, scale-out, {arm}, isolation {isolation}: {show(scale_out)}", flush=True)
    summary = {
        "bench": "confinement",
        "process_s": processes,
        "land_scale_out_s": land,
        "model": RESNET50_SIZED.label,
        "conditions": conditions,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
