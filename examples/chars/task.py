"""A small causal transformer language model over characters, trained on the source of a few
Python standard-library modules (corpus.py) cut into non-overlapping windows. It imports nothing
from Bungee."""

from __future__ import annotations

import torch
from corpus import corpus_text, vocabulary, window_count
from hyperparameters import CharTransformerHyperparameters
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset


class CharTransformer(nn.Module):
    """Token and learned position embeddings, pre-norm causal self-attention layers, and a
    linear head giving next-character logits at every position."""

    def __init__(self, vocab_size: int, block_size: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, length, vocab) for int64 tokens of (batch, length)."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


class Windows(Dataset):
    """Window i is `block_size` characters as tokens, and the same run shifted by one: the
    character each position predicts."""

    def __init__(self, block_size: int) -> None:
        index = {char: i for i, char in enumerate(vocabulary())}
        self.tokens = torch.tensor([index[char] for char in corpus_text()], dtype=torch.int64)
        self.block_size = block_size
        self.count = window_count(block_size)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        return self.tokens[start : start + self.block_size], self.tokens[start + 1 : start + self.block_size + 1]


class CharLanguageModel:
    Hyperparameters = CharTransformerHyperparameters

    def __init__(self, hyperparameters: CharTransformerHyperparameters) -> None:
        self.hp = hyperparameters

    def model(self) -> nn.Module:
        hp = self.hp
        return CharTransformer(len(vocabulary()), hp.block_size, hp.d_model, hp.layers, hp.heads)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.hp.lr)

    def train_data(self) -> Dataset:
        return Windows(self.hp.block_size)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = model(tokens)
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
