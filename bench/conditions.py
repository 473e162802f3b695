"""What the resize and overhead benchmarks share: the models they train, the conditions every
figure is printed with, and small statistics."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("BUNGEE_BENCH_REDIS_URL", os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/11"))


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
        return {
            "name": f"bench-{self.label}",
            "workload": "digits-mlp",
            "steps": steps,
            "seed": seed,
            # The plain data-parallel path (a hybrid job whose batch cannot change), which the
            # resize and overhead benchmarks measure; strict mode's cost is bench/consistency.py's.
            "max_workers": 4,
            "consistency": "hybrid",
            "batch_per_worker": self.batch_size,
            "min_batch_size": self.batch_size,
            "max_batch_size": self.batch_size,
            "hyperparameters": {
                "batch_size": self.batch_size,
                "hidden": self.hidden,
                "layers": self.layers,
                "dropout": 0.0,
                "lr": 0.01,
            },
        }


RESNET50_SIZED = BenchModel("25.6M", hidden=2060)
"""25.6M parameters, 205 MB of parameters and momentum: ResNet-50's size."""
LARGE = BenchModel("100M", hidden=4080)


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
