"""A task for bench/readahead.py: an MLP on synthetic vectors whose `__getitem__` waits
`item_s` seconds (a file read, a decode) before it returns its item; `data_workers` reader
processes, or none with `SlowItemsHere`."""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset


class Hyperparameters(BaseModel):
    batch_size: int = 64
    features: int = 256
    hidden: int = 1024
    layers: int = 4
    item_s: float = 0.0
    lr: float = 0.01


class Vectors(Dataset):
    def __init__(self, hp: Hyperparameters) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(4096, hp.features, generator=generator)
        self.labels = torch.randint(0, 10, (4096,), generator=generator)
        self.item_s = hp.item_s

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.item_s:
            time.sleep(self.item_s)
        return self.inputs[index] + 0.01 * torch.randn(self.inputs.shape[1]), self.labels[index]


class SlowItems:
    Hyperparameters = Hyperparameters
    data_workers = 2

    def __init__(self, hyperparameters: Hyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(self.hp.features, self.hp.hidden), nn.ReLU()]
        for _ in range(self.hp.layers - 1):
            layers += [nn.Linear(self.hp.hidden, self.hp.hidden), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(self.hp.hidden, 10))

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.hp.lr, momentum=0.9)

    def train_data(self) -> Vectors:
        return Vectors(self.hp)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        inputs, labels = batch
        logits = model(inputs)
        return functional.cross_entropy(logits, labels), {"accuracy": (logits.argmax(1) == labels).float().mean()}


class SlowItemsHere(SlowItems):
    data_workers = 0
