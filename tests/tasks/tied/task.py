"""Tasks written for the sharding tests: next-token prediction with an output layer tied to
the embedding and dropout; `Tied` has no buffers, `TiedNorm` adds batch norm. `shard_units`
names the units (the embedding and the output layer share their weight: sharded as one)."""

from __future__ import annotations

import torch
from pydantic import BaseModel
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

VOCABULARY, WIDTH, LENGTH = 29, 12, 6


class Sequences(Dataset):
    def __init__(self, count: int = 96) -> None:
        generator = torch.Generator().manual_seed(17)
        self.tokens = torch.randint(0, VOCABULARY, (count, LENGTH + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.hidden = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH + 1), nn.ReLU(), nn.Dropout(0.2), nn.Linear(2 * WIDTH + 1, WIDTH)
        )
        self.out = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(self.embed(tokens)))


class Hyperparameters(BaseModel):
    batch_size: int = 8
    lr: float = 0.01


class Tied:
    Hyperparameters = Hyperparameters

    def __init__(self, hyperparameters: Hyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        return TiedModel()

    def shard_units(self, model: TiedModel) -> list[nn.Module]:
        return [model.embed, model.hidden[0], model.hidden[3], model.out]

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.hp.lr)

    def train_data(self) -> Sequences:
        return Sequences()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


class TiedNormModel(TiedModel):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(2 * WIDTH + 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(tokens)
        first, rest = self.hidden[0], self.hidden[1:]
        hidden = self.norm(first(embedded).flatten(0, 1))
        return self.out(rest(hidden).view(*embedded.shape))


class TiedNorm(Tied):
    def model(self) -> nn.Module:
        return TiedNormModel()

    def shard_units(self, model: TiedModel) -> list[nn.Module]:
        assert isinstance(model, TiedNormModel)
        return [*super().shard_units(model), model.norm]
