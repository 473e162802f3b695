"""The workload interface. A workload is a task (elastic.tasks) that Bungee ships in `examples/`,
under a name a job may give instead of uploading code. Its metadata, hyperparameter schema and
epoch size load without torch (the portal validates specs with them); the task itself is imported
only inside a worker, exactly as a user's task is."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""The shipped tasks."""


def example_module(directory: str, name: str) -> ModuleType:
    """Imports `examples/<directory>/<name>.py`, a module of a shipped task that needs no torch,
    under a name of its own (`bungee_examples.<directory>.<name>`), without putting the
    directory on sys.path. Raises ImportError."""
    qualified = f"bungee_examples.{directory}.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, EXAMPLES / directory / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no module {name!r} in examples/{directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class WorkloadInfo:
    name: str
    title: str
    description: str
    directory: str
    """The task's directory under `examples/`."""
    entrypoint: str
    """`module:ClassName` of the task in that directory."""
    hyperparameters: type[BaseModel]
    """The task's schema, as the portal validates with it (the worker validates again with the
    task's own `Hyperparameters`)."""
    samples_per_epoch: Callable[[Any], int]
    """Number of training samples in one epoch for the given hyperparameters (no torch)."""

    @property
    def path(self) -> Path:
        return EXAMPLES / self.directory

    def schema(self) -> dict[str, Any]:
        """JSON schema of the hyperparameters, defaults included, for the API and the form."""
        return self.hyperparameters.model_json_schema()
