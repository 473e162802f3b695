"""Builder of the character-level transformer workload: a causal language model over the
corpus of `elastic.workloads.corpus`, cut into non-overlapping windows of `block_size`."""

from __future__ import annotations

import functools

import torch
from torch import nn

from elastic.workloads.corpus import corpus_text, vocabulary, window_count
from elastic.workloads.hyperparameters import CharTransformerHyperparameters
from elastic.workloads.problems import ClassificationProblem


class CharTransformer(nn.Module):
    """Token and learned position embeddings, pre-norm causal self-attention layers, and a
    linear head giving next-character logits at every position."""

    def __init__(self, vocab_size: int, block_size: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
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


def _windows(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (inputs, targets), each (windows, block_size) int64: targets are inputs shifted
    by one character."""
    vocab = vocabulary()
    index = {char: i for i, char in enumerate(vocab)}
    tokens = torch.tensor([index[char] for char in corpus_text()], dtype=torch.int64)
    count = window_count(block_size)
    span = count * block_size
    inputs = tokens[:span].reshape(count, block_size)
    targets = tokens[1 : span + 1].reshape(count, block_size)
    return inputs, targets


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def build_char_transformer(
    hyperparameters: CharTransformerHyperparameters, seed: int
) -> ClassificationProblem:
    """Return the character LM problem; the model's initial weights depend only on `seed`."""
    inputs, targets = _windows(hyperparameters.block_size)
    torch.manual_seed(seed)
    model = CharTransformer(
        vocab_size=len(vocabulary()),
        block_size=hyperparameters.block_size,
        d_model=hyperparameters.d_model,
        layers=hyperparameters.layers,
        heads=hyperparameters.heads,
    )
    return ClassificationProblem(
        model=model,
        inputs=inputs,
        targets=targets,
        optimizer_factory=functools.partial(_adamw, lr=hyperparameters.lr),
    )
