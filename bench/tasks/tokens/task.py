"""A task for the sharding benchmark (bench/sharding.py): next-token prediction on random
sequences with an embedding tied to the output layer and residual MLP blocks; 25.2M parameters
at the defaults. `shard_units`: the embedding and the output layer (one unit: they share their
weight), and each block."""

from __future__ import annotations

import torch
from pydantic import BaseModel
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(functional.gelu(self.up(self.norm(x))))


class TokenModel(nn.Module):
    def __init__(self, vocabulary: int, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
        self.out = nn.Linear(width, vocabulary, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(tokens)))


class RandomSequences(Dataset):
    def __init__(self, count: int, length: int, vocabulary: int) -> None:
        generator = torch.Generator().manual_seed(23)
        self.tokens = torch.randint(0, vocabulary, (count, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class Hyperparameters(BaseModel):
    batch_size: int = 8
    vocabulary: int = 8192
    width: int = 512
    blocks: int = 10
    length: int = 64
    lr: float = 1e-3


class Tokens:
    Hyperparameters = Hyperparameters

    def __init__(self, hyperparameters: Hyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        return TokenModel(self.hp.vocabulary, self.hp.width, self.hp.blocks)

    def shard_units(self, model: TokenModel) -> list[nn.Module]:
        return [model.embed, *model.blocks, model.out]

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.hp.lr)

    def train_data(self) -> RandomSequences:
        return RandomSequences(256, self.hp.length, self.hp.vocabulary)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
