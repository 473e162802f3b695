"""The TrainingProblem implementations the builders return. Imports torch: load it only inside a
worker (or a test), never from the portal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional


@dataclass
class ClassificationProblem:
    """Classify each input row into one of the classes given by `targets`; the loss is the mean
    cross-entropy over the rows passed in. For a language model the targets are a sequence per
    input and every position counts as one prediction of its row."""

    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer]

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of the model's logits for `inputs` against `targets`."""
        logits = self.model(inputs)
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def make_optimizer(self) -> torch.optim.Optimizer:
        """Return a fresh optimizer over the model's current parameters."""
        return self.optimizer_factory(self.model)
