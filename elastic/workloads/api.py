"""The workload interface. A workload is a real training problem that needs no download: its
metadata and hyperparameter schema import without torch (the portal validates specs with them),
and its `build` function, in a module loaded only inside a worker, makes the model and data."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch


class BaseHyperparameters(BaseModel):
    """Every workload takes at least a global batch size and a learning rate."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(64, ge=1, le=65536, description="global batch size, summed over workers")
    lr: float = Field(0.05, gt=0, le=10, description="learning rate")


class TrainingProblem(Protocol):
    """What a worker trains: a model, its training set as tensors, and a loss."""

    model: torch.nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def make_optimizer(self) -> torch.optim.Optimizer: ...


@dataclass(frozen=True)
class WorkloadInfo:
    name: str
    title: str
    description: str
    hyperparameters: type[BaseHyperparameters]
    samples_per_epoch: Callable[[Any], int]
    """Number of training samples in one epoch for the given hyperparameters (no torch)."""
    builder: str
    """Dotted path `module:function`; the function takes (hyperparameters, seed) and returns a
    TrainingProblem. Imported lazily, inside the worker, because it imports torch."""

    def build(self, hyperparameters: BaseHyperparameters, seed: int) -> TrainingProblem:
        module_name, _, function_name = self.builder.partition(":")
        build_function = getattr(importlib.import_module(module_name), function_name)
        problem: TrainingProblem = build_function(hyperparameters, seed)
        return problem

    def schema(self) -> dict[str, Any]:
        """JSON schema of the hyperparameters, defaults included, for the API and the form."""
        return self.hyperparameters.model_json_schema()
