"""The applications of a Pollux-format trace folder, as models the simulator can run.

For each application (a folder under `traces/`) we read:

- `placements.csv` and `scalability.csv`: measured step times against placement (GPUs per
  node) or node and replica counts, and the per-GPU batch. They are the simulator's ground
  truth: a job's step time is interpolated (linearly in the per-GPU batch) among the
  measurements of its exact placement shape (GPUs per node, in any node order; or, beyond four
  nodes, its node and replica counts), and comes from the fitted model only for shapes nobody
  measured or batches outside the measured range (scaled from the nearest measurement). We also
  fit one ThroughputModel to all of them: that is what the policies are told (an oracle, about
  5% off the measurements; `--learn-throughput` makes them learn it instead).
- `validation-B.csv`, one per global batch size B: progress (in base-batch steps), and the
  gradient statistics there. The smallest B is the base batch; the largest is the most a
  hybrid job may use. The job is done when its progress reaches the end of the base-batch run
  (every run ends at the same progress: the same accuracy). Gradient statistics at any progress
  and batch are interpolated linearly in progress and geometrically between the two nearest
  batch sizes.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from elastic.scheduling.goodput import GradientNoise
from elastic.scheduling.throughput import StepObservation, ThroughputModel, fit_throughput

DEFAULT_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "pollux"
"""Where the repository's sibling `shared/` folder keeps the Pollux artifact."""


class TraceError(ValueError):
    """A trace folder or file is missing or malformed."""


@dataclass(frozen=True)
class ValidationCurve:
    batch_size: int
    progress: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray


Shape = tuple[int, ...]


@dataclass(frozen=True)
class MeasuredSteps:
    """Measured step times by placement shape: GPUs per node, largest first (from
    placements.csv), or (0, nodes, replicas) for the spread-out runs of scalability.csv."""

    by_shape: dict[Shape, tuple[np.ndarray, np.ndarray]]
    """Shape to (per-GPU batches ascending, mean step times)."""

    @classmethod
    def from_rows(cls, rows: list[tuple[Shape, float, float]]) -> MeasuredSteps:
        grouped: dict[Shape, dict[float, list[float]]] = {}
        for shape, local, step in rows:
            grouped.setdefault(shape, {}).setdefault(local, []).append(step)
        return cls(
            {
                shape: (
                    np.array(sorted(points)),
                    np.array([float(np.mean(points[b])) for b in sorted(points)]),
                )
                for shape, points in grouped.items()
            }
        )

    def lookup(self, per_node: Shape, local: float, model: ThroughputModel) -> float | None:
        """The measured step time of `per_node` (GPUs on each node) at `local` samples per GPU,
        or None when that shape was not measured."""
        shape = tuple(sorted(per_node, reverse=True))
        points = self.by_shape.get(shape) or self.by_shape.get((0, len(shape), sum(shape)))
        if points is None:
            return None
        batches, steps = points
        nearest = float(np.clip(local, batches[0], batches[-1]))
        measured = float(np.interp(nearest, batches, steps))
        if nearest == local:
            return measured
        workers, nodes = sum(shape), len(shape)
        return measured * model.step_time(workers, nodes, local) / model.step_time(workers, nodes, nearest)


@dataclass(frozen=True)
class Application:
    name: str
    throughput: ThroughputModel
    fit_error: float
    """Median relative error of the fitted step time over the measurements."""
    base_batch_size: int
    max_batch_size: int
    min_local_batch: int
    max_local_batch: int
    target_progress: float
    curves: tuple[ValidationCurve, ...]
    measured: MeasuredSteps | None = None

    def step_time(self, per_node: Shape, local_batch: float, accumulation: int = 1) -> float:
        """Ground truth: seconds per step with `per_node` GPUs on each node, `local_batch`
        samples per micro-batch and `accumulation` micro-batches (see the module docstring)."""
        workers, nodes = sum(per_node), len(per_node)
        step = self.measured.lookup(per_node, local_batch, self.throughput) if self.measured else None
        if step is None:
            return self.throughput.step_time(workers, nodes, local_batch, accumulation)
        if accumulation > 1:
            alone = self.measured.lookup((1,), local_batch, self.throughput) if self.measured else None
            compute = alone if alone is not None else self.throughput.step_time(1, 1, local_batch)
            step += (accumulation - 1) * compute
        return step

    def gradient_noise(self, progress: float, batch_size: float) -> GradientNoise:
        sizes = [c.batch_size for c in self.curves]
        position = float(np.interp(math.log(batch_size), np.log(sizes), np.arange(len(sizes))))
        lower = int(math.floor(position))
        upper = min(lower + 1, len(sizes) - 1)
        weight = position - lower

        def at(curve: ValidationCurve) -> tuple[float, float]:
            return (
                float(np.interp(progress, curve.progress, curve.grad_sqr)),
                float(np.interp(progress, curve.progress, curve.grad_var)),
            )

        sqr_low, var_low = at(self.curves[lower])
        sqr_high, var_high = at(self.curves[upper])
        sqr = sqr_low ** (1 - weight) * sqr_high**weight
        var = var_low ** (1 - weight) * var_high**weight
        return GradientNoise(self.base_batch_size, sqr, var)


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise TraceError(f"missing trace file {str(path)!r}")
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _observations(folder: Path) -> tuple[list[StepObservation], list[tuple[Shape, float, float]]]:
    observed = []
    shaped: list[tuple[Shape, float, float]] = []
    for row in _read_rows(folder / "placements.csv"):
        per_node = tuple(sorted((int(c) for c in row["placement"] if c != "0"), reverse=True))
        local, step = float(row["local_bsz"]), float(row["step_time"])
        observed.append(StepObservation(sum(per_node), len(per_node), local, 1, step))
        shaped.append((per_node, local, step))
    for row in _read_rows(folder / "scalability.csv"):
        nodes, replicas = int(row["num_nodes"]), int(row["num_replicas"])
        local, step = float(row["local_bsz"]), float(row["step_time"])
        observed.append(StepObservation(replicas, nodes, local, 1, step))
        shaped.append(((0, nodes, replicas), local, step))
    return observed, shaped


def _curves(folder: Path) -> tuple[ValidationCurve, ...]:
    curves = []
    for path in folder.glob("validation-*.csv"):
        match = re.fullmatch(r"validation-(\d+)\.csv", path.name)
        if not match:
            continue
        rows = _read_rows(path)
        if not rows:
            raise TraceError(f"empty validation file {str(path)!r}")
        curves.append(
            ValidationCurve(
                int(match.group(1)),
                np.array([float(r["progress"]) for r in rows]),
                np.array([max(float(r["grad_sqr"]), 1e-30) for r in rows]),
                np.array([max(float(r["grad_var"]), 1e-30) for r in rows]),
            )
        )
    if not curves:
        raise TraceError(f"no validation-B.csv files in {str(folder)!r}")
    return tuple(sorted(curves, key=lambda c: c.batch_size))


def load_application(folder: Path) -> Application:
    """Reads and fits one application folder. Raises TraceError when files are missing."""
    observed, shaped = _observations(folder)
    model = fit_throughput(observed)
    predicted = np.array([model.step_time(o.workers, o.nodes, o.local_batch) for o in observed])
    measured = np.array([o.step_time_s for o in observed])
    curves = _curves(folder)
    local = [o.local_batch for o in observed]
    return Application(
        name=folder.name,
        throughput=model,
        fit_error=float(np.median(np.abs(predicted / measured - 1))),
        base_batch_size=curves[0].batch_size,
        max_batch_size=curves[-1].batch_size,
        min_local_batch=int(min(local)),
        max_local_batch=int(max(local)),
        target_progress=float(curves[0].progress[-1]),
        curves=curves,
        measured=MeasuredSteps.from_rows(shaped),
    )


@cache
def load_applications(root: Path = DEFAULT_TRACES) -> dict[str, Application]:
    """Every application under `root/traces`, by name. Raises TraceError if there are none."""
    folder = root / "traces"
    if not folder.is_dir():
        raise TraceError(f"no trace folder at {str(folder)!r} (pass --traces)")
    apps = {p.name: load_application(p) for p in sorted(folder.iterdir()) if (p / "placements.csv").is_file()}
    if not apps:
        raise TraceError(f"no applications under {str(folder)!r}")
    return apps
