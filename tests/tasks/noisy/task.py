"""A task written only for the tests of reader processes (elastic.tasks.readers): each item is a
fixed point plus noise drawn in `__getitem__`, so what an item is depends on the generator state
it was read with; the item at index 13 raises when `broken` is set; with `points_per_step` the
data set has that many points for each of the job's steps (its `job`, in every reader too)."""

from __future__ import annotations

import torch
from pydantic import BaseModel
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset


class NoisyPoints(Dataset):
    def __init__(self, broken: bool, count: int = 120) -> None:
        self.points = torch.linspace(-1, 1, 2 * count).reshape(count, 2)
        self.broken = broken

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.broken and index == 13:
            raise KeyError(f"item {index} is broken")
        point = self.points[index] + 0.1 * torch.randn(2)
        return point, torch.tensor(int(point.sum() > 0))


class Hyperparameters(BaseModel):
    batch_size: int = 12
    broken: bool = False
    points_per_step: int = 0


class Noisy:
    Hyperparameters = Hyperparameters
    data_workers = 2

    def __init__(self, hyperparameters: Hyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def train_data(self) -> NoisyPoints:
        if self.hp.points_per_step:
            return NoisyPoints(self.hp.broken, self.hp.points_per_step * self.job.steps)
        return NoisyPoints(self.hp.broken)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        points, labels = batch
        return functional.cross_entropy(model(points), labels)


class NoisyOneReader(Noisy):
    data_workers = 1


class NoisyHere(Noisy):
    data_workers = 0


class NoisyMetrics(NoisyHere):
    """Read here, with three metrics returned as tensors, as a task written for a GPU would."""

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        points, labels = batch
        logits = model(points)
        probabilities = logits.softmax(dim=1)
        return functional.cross_entropy(logits, labels), {
            "accuracy": (logits.argmax(dim=1) == labels).float().mean(),
            "confidence": probabilities.amax(dim=1).mean(),
            "spread": logits.std(),
        }


class NoisyMixed(Noisy):
    """Items whose label is an int below index 60 and a float from there: readers whose shares
    hold one kind each stack them differently, so the batch is collated from the items."""

    def train_data(self) -> Dataset:
        points = NoisyPoints(self.hp.broken)

        class Mixed(Dataset):
            def __len__(self) -> int:
                return len(points)

            def __getitem__(self, index: int) -> dict:
                point, label = points[index]
                return {"point": point, "label": int(label) if index < 60 else float(label)}

        return Mixed()

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return functional.cross_entropy(model(batch["point"]), batch["label"].long())
