"""Two tasks on scikit-learn's bundled 8x8 handwritten digits: a perceptron and a small CNN.

The first 1,437 images train, the other 360 are held out for evaluation. Copy this directory to
start a task of your own: it imports nothing from Bungee."""

from __future__ import annotations

from functools import lru_cache

import torch
from hyperparameters import DigitsCNNHyperparameters, DigitsHyperparameters, DigitsMLPHyperparameters
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

IMAGES = 1797
TRAIN_IMAGES = 1437
CLASSES = 10


@lru_cache(maxsize=1)
def _all_digits() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    if len(digits.target) != IMAGES:
        raise RuntimeError(f"scikit-learn's digits has {len(digits.target)} images, expected {IMAGES}")
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.int64)


class Digits(Dataset):
    """The training images (`held_out` False) or the held-out ones, each `(pixels, label)` with
    the pixels in [0, 1] shaped `shape`."""

    def __init__(self, held_out: bool, shape: tuple[int, ...]) -> None:
        images, labels = _all_digits()
        part = slice(TRAIN_IMAGES, None) if held_out else slice(0, TRAIN_IMAGES)
        self.images, self.labels, self.shape = images[part], labels[part], shape

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index].reshape(self.shape), self.labels[index]


class _DigitsTask:
    """What both digits tasks share: the data, SGD, cross-entropy and accuracy."""

    shape: tuple[int, ...] = (64,)

    def __init__(self, hyperparameters: DigitsHyperparameters) -> None:
        self.hp = hyperparameters

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.hp.lr, momentum=self.hp.momentum)

    def train_data(self) -> Dataset:
        return Digits(held_out=False, shape=self.shape)

    def eval_data(self) -> Dataset:
        return Digits(held_out=True, shape=self.shape)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return functional.cross_entropy(model(images), labels)

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"accuracy": (model(images).argmax(dim=1) == labels).float().mean()}


class DigitsMLP(_DigitsTask):
    """A perceptron with `layers` hidden layers of `hidden` units."""

    Hyperparameters = DigitsMLPHyperparameters
    hp: DigitsMLPHyperparameters

    def model(self) -> nn.Module:
        width = self.hp.hidden
        deeper = [layer for _ in range(self.hp.layers - 1) for layer in (nn.Linear(width, width), nn.ReLU())]
        return nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), *deeper, nn.Dropout(self.hp.dropout), nn.Linear(width, CLASSES)
        )


class DigitsCNN(_DigitsTask):
    """Two convolutions with batch norm, max pooling, dropout and a linear classifier. Batch norm
    takes its statistics over the batch and the 8x8 positions, so a worker whose share of a
    step is a single image still trains."""

    Hyperparameters = DigitsCNNHyperparameters
    hp: DigitsCNNHyperparameters
    shape = (1, 8, 8)

    def model(self) -> nn.Module:
        channels = self.hp.channels
        return nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(self.hp.dropout),
            nn.Linear(2 * channels * 4 * 4, CLASSES),
        )
