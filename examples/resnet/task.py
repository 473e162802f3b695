"""A CIFAR-style ResNet-18 on synthetic images: a task as a user writes it, with no download.

Each image is made from its index alone (its class's pattern plus noise from a generator seeded
with the index), then read as a CIFAR loader would: a random 32x32 crop of the image padded by
4 and a horizontal flip, both drawn from torch's global generator, which Bungee seeds. Copy this
directory to start a task of your own: it imports nothing from Bungee."""

from __future__ import annotations

import torch
from hyperparameters import ResNetHyperparameters
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

CLASSES = 10
SIZE = 32
PAD = 4
HELD_OUT = 1_000
HELD_OUT_START = 1 << 40
"""The held-out images' indices start here, far from any training image's."""


class SyntheticImages(Dataset):
    """`count` images of 3x32x32 with labels: image i is class i % 10's fixed pattern plus
    noise seeded by `first + i`. With `augment`, each read takes a random crop (padding 4) and a
    random horizontal flip."""

    def __init__(self, count: int, first: int = 0, augment: bool = True) -> None:
        self.count, self.first, self.augment = count, first, augment
        patterns = torch.Generator().manual_seed(12345)
        self.patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=patterns)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        label = index % CLASSES
        noise = torch.Generator().manual_seed(self.first + index)
        image = self.patterns[label] + torch.randn(3, SIZE, SIZE, generator=noise)
        if self.augment:
            padded = functional.pad(image, (PAD, PAD, PAD, PAD))
            top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
            image = padded[:, top : top + SIZE, left : left + SIZE]
            if torch.rand(()) < 0.5:
                image = image.flip(2)
        return image, torch.tensor(label)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution where the shape
    changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = functional.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return functional.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: a 3x3 stem, four stages of two blocks, average pooling."""

    def __init__(self, width: int = 64, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, inputs = [], width
        for stage, stride in enumerate((1, 2, 2, 2)):
            outputs = width * 2**stage
            blocks += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
            inputs = outputs
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        # A mean over the positions, not adaptive_avg_pool2d: its backward on a GPU has no
        # deterministic kernel, which strict mode asks for.
        return self.head(features.mean(dim=(2, 3)))


class ResNetTask:
    """ResNet-18 trained by SGD with momentum and weight decay on the synthetic images."""

    Hyperparameters = ResNetHyperparameters
    data_workers = 0
    """Read the items in the worker: making one takes microseconds."""

    def __init__(self, hyperparameters: ResNetHyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        return ResNet18(self.hp.width)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            model.parameters(), lr=self.hp.lr, momentum=self.hp.momentum, weight_decay=self.hp.weight_decay
        )

    def train_data(self) -> Dataset:
        return SyntheticImages(self.hp.images)

    def eval_data(self) -> Dataset:
        return SyntheticImages(HELD_OUT, first=HELD_OUT_START, augment=False)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        images, labels = batch
        logits = model(images)
        accuracy = (logits.argmax(1) == labels).float().mean()  # a tensor: no wait for the GPU here
        return functional.cross_entropy(logits, labels), {"accuracy": accuracy}

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        images, labels = batch
        return {"accuracy": (model(images).argmax(1) == labels).float().mean()}
