"""The plots of bench/RESULTS.md, drawn from the JSON line each benchmark run ended with (its
output is kept under bench/results/). Each figure names the runs it draws, so that a new run
changes a plot only when this file is pointed at it, and says their conditions.

    python bench/plots.py [--results DIR] [--out DIR]   # PNGs into bench/results/plots/
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PLOTS = RESULTS / "plots"

LAND_RUN = "land-three-arms-touched-receive-cpu-2core-amd-2026-11-26.txt"
"""The latest run of bench/land.py with its three arms side by side."""
STRICT_RUNS = {
    ("one process, 1.6M MLP\n(profile_step)", "CPU, 2-core VM"): "profile-step-cpu-2core-intel-2026-11-25.txt",
    ("one process, 1.6M MLP\n(profile_step)", "H100"): "profile-step-h100.txt",
    ("2 workers, 2.2M MLP\n(consistency)", "CPU, 2-core VM"): "consistency-turns-cpu-2core-amd-2026-11-26.txt",
    ("2 workers, 2.2M MLP\n(consistency)", "H100"): "consistency-quick-h100-shared-gpu.txt",
}
"""Strict mode's step against plain averaging's, by where it ran. On the one H100, two workers
share the GPU over gloo (NCCL refuses two ranks on one GPU)."""
LIVE_RUNS = {
    "quiet VM": ["live-1024-cpu-2core-2026-11-24.txt", "live-1024-cpu-2core-amd-2026-11-26.txt"],
    "loaded VM": [
        "live-64-cpu-2core-loaded-2026-11-26.txt",
        "live-256-cpu-2core-loaded-2026-11-26.txt",
        "live-1024-cpu-2core-loaded-2026-11-26.txt",
    ],
}
"""bench/live.py runs, 50 sockets each, by the load the machine had."""
RESIZE_RUNS = {
    "CPU, 2-core VM": "resize-quick-5rounds-cpu-2core-amd-2026-11-26.txt",
    "H100 (workers share it)": "resize-quick-h100-shared-gpu.txt",
}
"""bench/resize.py --quick runs: the in-place pause by kind of resize, 25.6M model."""


def last_json(path: Path) -> dict[str, Any]:
    """The last JSON object a run printed (a line, or the end of one after a label). Raises
    ValueError naming the file if there is none."""
    found = None
    for line in path.read_text(errors="replace").splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            found = value
    if found is None:
        raise ValueError(f"{path} holds no JSON line")
    return found


def _load(data: dict[str, Any]) -> str:
    conditions = data.get("conditions") or data
    load = conditions.get("load_average_1m")
    if load is None and isinstance(data.get("load_average"), list):
        load = data["load_average"][0]
    return f"load {load:g}" if isinstance(load, (int, float)) else "load not recorded"


def _quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of `values`."""
    first, _, third = statistics.quantiles(values, n=4)
    return first, third


def land_by_kind(results: Path) -> Figure:
    """Land time (the API call to the first step of the new generation) by kind of resize and
    by how the joiner starts: min / median / max of each."""
    data = last_json(results / LAND_RUN)
    arms = {"standbys": "warm standby, prepared", "unprepared": "warm standby, not prepared", "cold": "cold start"}
    kinds = list(data["land_by_scenario_s"])
    figure, axes = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(arms)
    for index, (arm, label) in enumerate(arms.items()):
        rows = [data["land_by_scenario_s"][kind][arm] for kind in kinds]
        medians = [row["median"] for row in rows]
        low = [row["median"] - row["min"] for row in rows]
        high = [row["max"] - row["median"] for row in rows]
        positions = [k + (index - 1) * width for k in range(len(kinds))]
        bars = axes.bar(positions, medians, width, yerr=[low, high], capsize=3, label=label)
        axes.bar_label(bars, fmt="%.2f s", padding=2, fontsize="small")
    axes.set_xticks(range(len(kinds)), kinds)
    axes.set_ylabel("seconds (median; bars: min to max)")
    runs = data["land_by_scenario_s"][kinds[0]]["standbys"]["n"]
    axes.set_title(f"Land time by kind of resize ({data['model']} model, {runs} rounds, {_load(data)})")
    axes.legend()
    return figure


def strict_overhead_by_device(results: Path) -> Figure:
    """Strict mode's step time over plain averaging's, CPU against H100, in one process and
    with two workers; the bars span the rounds' middle half where the run kept its rounds."""
    figure, axes = plt.subplots(figsize=(7.5, 4))
    setups = sorted({setup for setup, _ in STRICT_RUNS}, key=list(dict.fromkeys(s for s, _ in STRICT_RUNS)).index)
    devices = list(dict.fromkeys(device for _, device in STRICT_RUNS))
    width = 0.8 / len(devices)
    for index, device in enumerate(devices):
        medians, low, high = [], [], []
        for setup in setups:
            data = last_json(results / STRICT_RUNS[setup, device])
            rounds = data.get("step_overhead_per_round_pct") or data.get("overhead_per_pair_pct")
            median = data.get("strict_step_overhead_pct", data["strict_overhead_pct"])
            lowest, highest = _quartiles(rounds) if rounds and len(rounds) > 2 else (min(rounds or [median]), max(rounds or [median]))
            medians.append(median)
            low.append(max(0.0, median - lowest))
            high.append(max(0.0, highest - median))
        positions = [s + (index - 0.5) * width for s in range(len(setups))]
        bars = axes.bar(positions, medians, width, yerr=[low, high], capsize=3, label=device)
        axes.bar_label(bars, fmt="%+.1f %%", padding=2)
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(setups)), setups)
    axes.set_ylabel("strict step over plain, % (median;\nbars: rounds' middle half)")
    axes.set_title("What strict mode costs a step, by device")
    axes.legend()
    return figure


def live_latency_by_devices(results: Path) -> Figure:
    """Push latency to the board (a sample taken on the node to its arrival in each of 50
    sockets): p50 and p95 by the number of devices, for each machine load."""
    figure, axes = plt.subplots(figsize=(7.5, 4))
    for (label, files), marker in zip(LIVE_RUNS.items(), ("o", "s"), strict=False):
        runs = sorted((last_json(results / name) for name in files if (results / name).exists()),
                      key=lambda run: run["devices"])
        if not runs:
            continue
        devices = [run["devices"] for run in runs]
        loads = ", ".join(f"{run['load_average'][0]:g}" for run in runs)
        axes.plot(devices, [run["p95_ms"] for run in runs], marker=marker, label=f"p95, {label} (load {loads})")
        axes.plot(devices, [run["p50_ms"] for run in runs], marker=marker, linestyle="--", label=f"p50, {label}")
    axes.axhline(300, color="grey", linewidth=0.8, linestyle=":", label="target: p95 300 ms")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    every = sorted({run_devices for files in LIVE_RUNS.values() for run_devices in _devices(results, files)})
    axes.set_xticks(every, [f"{count:,}" for count in every])
    axes.set_yticks([50, 100, 200, 500, 1000, 2000], ["50", "100", "200", "500", "1,000", "2,000"])
    axes.set_xlabel("simulated devices on the board")
    axes.set_ylabel("ms from sample to socket")
    axes.set_title("Live board latency by devices (50 sockets, 2-core VM)")
    axes.legend(fontsize="small")
    return figure


def _devices(results: Path, files: list[str]) -> list[int]:
    return [last_json(results / name)["devices"] for name in files if (results / name).exists()]


def resize_pause_by_kind(results: Path) -> Figure:
    """The in-place pause (last step before the switch to the first after, less a normal step)
    by kind of resize, median of each, CPU against H100."""
    figure, axes = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(RESIZE_RUNS)
    kinds: list[str] = []
    for index, (label, name) in enumerate(RESIZE_RUNS.items()):
        data = last_json(results / name)
        pauses = data["pause_median_by_scenario_s"]
        kinds = kinds or list(pauses)
        positions = [k + (index - 0.5) * width for k in range(len(kinds))]
        axes.bar(positions, [pauses.get(kind, 0.0) for kind in kinds], width, label=f"{label}, {_load(data)}")
    axes.set_xticks(range(len(kinds)), kinds, fontsize="small")
    axes.set_ylabel("pause, seconds (median)")
    axes.set_title("In-place resize pause by kind (25.6M model, --quick)")
    axes.legend()
    return figure


FIGURES: dict[str, Callable[[Path], Figure]] = {
    "land-by-kind.png": land_by_kind,
    "strict-overhead-by-device.png": strict_overhead_by_device,
    "live-latency-by-devices.png": live_latency_by_devices,
    "resize-pause-by-kind.png": resize_pause_by_kind,
}


def draw(results: Path, out: Path) -> list[Path]:
    """Draws every figure from the runs under `results` into `out`; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in FIGURES.items():
        figure = make(results)
        figure.tight_layout()
        # No timestamp in the file, so that the same runs give the same bytes.
        figure.savefig(out / name, dpi=100, metadata={"Software": None})
        plt.close(figure)
        written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the runs' output is")
    parser.add_argument("--out", type=Path, default=PLOTS, help="where the PNGs go")
    args = parser.parse_args(argv)
    for path in draw(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
