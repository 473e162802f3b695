"""What the resize and overhead benchmarks share: the models they train, the conditions every
figure is printed with, and small statistics."""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("BUNGEE_BENCH_REDIS_URL", os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/11"))
PYTHON_PATH = os.pathsep.join(path for path in (str(ROOT), os.environ.get("PYTHONPATH")) if path)
"""The project first, then what the caller had (packages installed beside the interpreter's)."""


@dataclass(frozen=True)
class BenchModel:
    """A deep MLP of the digits-mlp workload, sized by its width (SGD with momentum)."""

    label: str
    hidden: int
    layers: int = 7
    batch_size: int = 64

    @property
    def parameters(self) -> int:
        first = 64 * self.hidden + self.hidden
        middle = (self.layers - 1) * (self.hidden * self.hidden + self.hidden)
        return first + middle + self.hidden * 10 + 10

    @property
    def state_bytes(self) -> int:
        """Parameters and momentum, float32."""
        return 8 * self.parameters

    def spec(self, steps: int, seed: int = 0) -> dict[str, Any]:
        hyperparameters = {"batch_size": self.batch_size, "hidden": self.hidden, "layers": self.layers,
                           "dropout": 0.0, "lr": 0.01}
        return plain_spec(self.label, {"workload": "digits-mlp"}, self.batch_size, hyperparameters, steps, seed)


    @property
    def task(self) -> tuple[Path, str] | None:
        """The job's own code, (directory, entrypoint); None: the digits-mlp workload."""
        return None


@dataclass(frozen=True)
class TaskModel:
    """A user's task (elastic.tasks) in place of the digits MLP: `--task DIR --entrypoint M:C`.
    Its spec names the code by the digest the portal would give the directory."""

    directory: Path
    entrypoint: str
    hyperparameters: dict[str, Any]
    label: str = "task"

    @property
    def batch_size(self) -> int:
        return int(self.hyperparameters["batch_size"])

    @property
    def task(self) -> tuple[Path, str] | None:
        return (self.directory, self.entrypoint)

    @functools.cached_property
    def _sizes(self) -> tuple[int, int]:
        """(parameters, bytes of the model's and the optimiser's state after one step)."""
        from elastic.tasks.runtime import bind_task

        bound = bind_task(self.directory, self.entrypoint, self.hyperparameters, seed=0)
        optimizer = bound.make_optimizer()
        bound.loss(bound.batch(range(min(self.batch_size, bound.num_samples)))).backward()
        optimizer.step()
        tensors = [*bound.model.state_dict().values(), *_tensors(optimizer.state_dict()["state"])]
        return (
            sum(p.numel() for p in bound.model.parameters()),
            sum(t.numel() * t.element_size() for t in tensors),
        )

    @property
    def parameters(self) -> int:
        return self._sizes[0]

    @property
    def state_bytes(self) -> int:
        return self._sizes[1]

    @functools.cached_property
    def digest(self) -> str:
        import io

        from elastic.codepack import pack_directory

        return pack_directory(self.directory, io.BytesIO(), 1 << 30, 100_000).digest

    def spec(self, steps: int, seed: int = 0) -> dict[str, Any]:
        task = {"code": self.digest, "entrypoint": self.entrypoint}
        return plain_spec(self.label, task, self.batch_size, self.hyperparameters, steps, seed)


def plain_spec(
    label: str, task: dict[str, Any], batch: int, hyperparameters: dict[str, Any], steps: int, seed: int
) -> dict[str, Any]:
    """A job on the plain data-parallel path (a hybrid job whose batch cannot change), which the
    resize and overhead benchmarks measure; strict mode's cost is bench/consistency.py's."""
    return {
        "name": f"bench-{label}", **task, "steps": steps, "seed": seed, "max_workers": 4,
        "consistency": "hybrid", "batch_per_worker": batch, "min_batch_size": batch, "max_batch_size": batch,
        "hyperparameters": hyperparameters,
    }


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


RESNET50_SIZED = BenchModel("25.6M", hidden=2060)
"""25.6M parameters, 205 MB of parameters and momentum: ResNet-50's size."""
LARGE = BenchModel("100M", hidden=4080)


def shared_gpu_env(device: str, workers: int) -> dict[str, str]:
    """The workers' environment for `workers` workers on `device`: where the machine has fewer
    GPUs than workers, they all share GPU 0 over gloo (NCCL refuses two ranks on one GPU)."""
    import torch

    return {"BUNGEE_SHARED_GPU": "1"} if device == "cuda" and torch.cuda.device_count() < workers else {}


def machine() -> dict[str, Any]:
    """The conditions a figure was measured in."""
    import torch

    load = os.getloadavg()
    return {
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_1m": round(load[0], 2),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def spread(values: list[float]) -> dict[str, float | int | None]:
    """min, median, max and count of `values` (None where there are none)."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def show(values: list[float], unit: str = "s", digits: int = 3) -> str:
    """'min / median / max (n)' for a table cell."""
    stats = spread(values)
    if not stats["n"]:
        return "-"
    return (
        f"{stats['min']:.{digits}f} / {stats['median']:.{digits}f} / {stats['max']:.{digits}f} {unit} "
        f"(n={stats['n']})"
    )


@dataclass(frozen=True)
class RoundRatios:
    """Ours against a baseline over rounds that each ran both: each round's ratio of medians
    (percent over the baseline), their median, the ratio of the pooled medians, and the
    interquartile range of the rounds' ratios (how far the middle half agree)."""

    per_round: list[float]
    median: float
    pooled: float
    iqr: float

    @classmethod
    def of(cls, ours: list[list[float]], theirs: list[list[float]]) -> RoundRatios:
        """From each round's times of ours and the baseline's; a round where either has none is
        left out."""
        pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if a and b]
        per_round = [(statistics.median(a) / statistics.median(b) - 1) * 100 for a, b in pairs]
        pooled_ours = [time for a, _ in pairs for time in a]
        pooled_theirs = [time for _, b in pairs for time in b]
        quartiles = statistics.quantiles(per_round, n=4)
        return cls(
            per_round=per_round,
            median=statistics.median(per_round),
            pooled=(statistics.median(pooled_ours) / statistics.median(pooled_theirs) - 1) * 100,
            iqr=quartiles[2] - quartiles[0],
        )

    def describe(self) -> str:
        return (
            f"per round (min / median / max): {min(self.per_round):+.2f} / {self.median:+.2f} / "
            f"{max(self.per_round):+.2f}%; half the rounds within {self.iqr:.1f} points; ratio of the "
            f"pooled medians {self.pooled:+.2f}%"
        )
