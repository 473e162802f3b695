"""Builders of the two digits workloads: scikit-learn's bundled 8x8 handwritten digits, the first
DIGITS_TRAIN_SAMPLES images as the training set, pixels scaled to [0, 1]."""

from __future__ import annotations

import functools

import torch
from sklearn.datasets import load_digits
from torch import nn

from elastic.workloads.catalogue import DIGITS_SAMPLES, DIGITS_TRAIN_SAMPLES
from elastic.workloads.hyperparameters import DigitsCNNHyperparameters, DigitsMLPHyperparameters
from elastic.workloads.problems import ClassificationProblem

DIGITS_CLASSES = 10
_MAX_PIXEL = 16.0


def _train_split() -> tuple[torch.Tensor, torch.Tensor]:
    """Return the training images as float rows of 64 pixels and their int64 labels.

    Raises RuntimeError if the bundled data set is not the expected size.
    """
    digits = load_digits()
    if len(digits.target) != DIGITS_SAMPLES:
        raise RuntimeError(
            f"scikit-learn's digits has {len(digits.target)} images, expected {DIGITS_SAMPLES}"
        )
    images = torch.tensor(digits.data[:DIGITS_TRAIN_SAMPLES], dtype=torch.float32) / _MAX_PIXEL
    labels = torch.tensor(digits.target[:DIGITS_TRAIN_SAMPLES], dtype=torch.int64)
    return images, labels


def held_out_accuracy(model: nn.Module, images_shape: tuple[int, ...] = (-1, 64)) -> float:
    """Return the accuracy of `model` (put in eval mode) on the digits no job trains on: the
    images after the first DIGITS_TRAIN_SAMPLES, reshaped to `images_shape` ((-1, 1, 8, 8) for
    the CNN)."""
    digits = load_digits()
    images = torch.tensor(digits.data[DIGITS_TRAIN_SAMPLES:], dtype=torch.float32) / _MAX_PIXEL
    labels = torch.tensor(digits.target[DIGITS_TRAIN_SAMPLES:], dtype=torch.int64)
    model.eval()
    with torch.no_grad():
        predicted = model(images.reshape(images_shape)).argmax(dim=1)
    return float((predicted == labels).float().mean())


def _sgd(model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def build_mlp(hyperparameters: DigitsMLPHyperparameters, seed: int) -> ClassificationProblem:
    """Return the digits MLP problem; the model's initial weights depend only on `seed`. With
    more than one layer it is a deep MLP, sized for the resize benchmarks (bench/)."""
    images, labels = _train_split()
    torch.manual_seed(seed)
    width = hyperparameters.hidden
    deeper = [
        module for _ in range(hyperparameters.layers - 1) for module in (nn.Linear(width, width), nn.ReLU())
    ]
    model = nn.Sequential(
        nn.Linear(images.shape[1], width),
        nn.ReLU(),
        *deeper,
        nn.Dropout(hyperparameters.dropout),
        nn.Linear(width, DIGITS_CLASSES),
    )
    return ClassificationProblem(
        model=model,
        inputs=images,
        targets=labels,
        optimizer_factory=functools.partial(_sgd, lr=hyperparameters.lr, momentum=hyperparameters.momentum),
    )


def build_cnn(hyperparameters: DigitsCNNHyperparameters, seed: int) -> ClassificationProblem:
    """Return the digits CNN problem; the model's initial weights depend only on `seed`.

    Batch norm uses 2-d statistics (over the batch and the 8x8 positions), so a worker whose
    share of a step is a single image still trains.
    """
    images, labels = _train_split()
    channels = hyperparameters.channels
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(hyperparameters.dropout),
        nn.Linear(2 * channels * 4 * 4, DIGITS_CLASSES),
    )
    return ClassificationProblem(
        model=model,
        inputs=images.reshape(-1, 1, 8, 8),
        targets=labels,
        optimizer_factory=functools.partial(_sgd, lr=hyperparameters.lr, momentum=hyperparameters.momentum),
    )
