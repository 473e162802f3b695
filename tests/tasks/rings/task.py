"""A task written only for the tests (not one of the examples): which of three rings a point lies
on. A small network with batch norm and dropout, its own Dataset over a file it ships, a collate
function of its own, metrics from both `loss` and `evaluate`, and, when asked, a learning-rate
scheduler, a bug in `loss`, a NaN loss, a slow model() or an exit handler of its own."""

from __future__ import annotations

import atexit
import time
from pathlib import Path

import torch
from data import Rings
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional


class RingsHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(24, ge=1)
    lr: float = Field(0.1, gt=0)
    hidden: int = Field(32, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    lr_decay_every: int = Field(0, ge=0, description="halve the rate every this many steps (0: no scheduler)")
    fail_at_call: int = Field(0, ge=0, description="raise in loss() on this call (0: never)")
    nan_at_call: int = Field(0, ge=0, description="return a NaN loss on this call (0: never)")
    slow_model_s: float = Field(0, ge=0, description="model() first creates `slow_model_marker`, then sleeps this long")
    slow_model_marker: str = ""
    exit_marker: str = Field("", description="model() registers an atexit handler that writes this file")


class RingsTask:
    Hyperparameters = RingsHyperparameters

    def __init__(self, hyperparameters: RingsHyperparameters) -> None:
        self.hp = hyperparameters
        self.calls = 0

    def model(self) -> nn.Module:
        if self.hp.exit_marker:
            marker = Path(self.hp.exit_marker)
            atexit.register(lambda: marker.write_text(f"loss called {self.calls} times"))
        if self.hp.slow_model_s:
            Path(self.hp.slow_model_marker).touch()
            time.sleep(self.hp.slow_model_s)
        return nn.Sequential(
            nn.Linear(3, self.hp.hidden),
            nn.BatchNorm1d(self.hp.hidden),
            nn.ReLU(),
            nn.Dropout(self.hp.dropout),
            nn.Linear(self.hp.hidden, 3),
        )

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.hp.lr, momentum=0.9)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        if not self.hp.lr_decay_every:
            return None
        every = self.hp.lr_decay_every
        # A closed-form schedule (from the scheduler's own step count), unlike the chainable
        # StepLR: a worker that missed the scheduler's state would restart it at the full rate.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // every))

    def train_data(self) -> Rings:
        return Rings(held_out=False)

    def eval_data(self) -> Rings:
        return Rings(held_out=True)

    def collate(self, items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        points = torch.stack([item["point"] for item in items])
        radius = points.norm(dim=1, keepdim=True)
        return torch.cat([points, radius], dim=1), torch.stack([item["ring"] for item in items])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        self.calls += 1
        if self.calls == self.hp.fail_at_call:
            raise ValueError(f"the task's own bug, at call {self.calls}")
        features, rings = batch
        logits = model(features)
        accuracy = (logits.argmax(dim=1) == rings).float().mean()
        loss = functional.cross_entropy(logits, rings)
        if self.calls == self.hp.nan_at_call:
            loss = loss * float("nan")
        return loss, {"accuracy": float(accuracy)}

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        features, rings = batch
        logits = model(features)
        return {
            "accuracy": float((logits.argmax(dim=1) == rings).float().mean()),
            "loss": float(functional.cross_entropy(logits, rings)),
        }
