"""The hyperparameter schemas of the catalogue's workloads. They import without torch, because
the portal validates submitted specs with them; the builders that use them live beside them."""

from __future__ import annotations

from pydantic import Field, model_validator

from elastic.workloads.api import BaseHyperparameters


class DigitsMLPHyperparameters(BaseHyperparameters):
    """An MLP with `layers` hidden layers (one by default), trained by SGD with momentum."""

    hidden: int = Field(64, ge=1, le=4096, description="width of each hidden layer")
    layers: int = Field(
        1, ge=1, le=16, description="hidden layers (7 layers of 2060 make a 25.6M-parameter model)"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout probability after the hidden layer")


class DigitsCNNHyperparameters(BaseHyperparameters):
    """Two convolutions with batch norm, then dropout and a linear classifier, trained by SGD."""

    channels: int = Field(
        16, ge=1, le=256, description="channels of the first convolution (the second has twice as many)"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout probability before the classifier")


class CharTransformerHyperparameters(BaseHyperparameters):
    """A causal transformer language model over characters, trained by AdamW."""

    batch_size: int = Field(
        32, ge=1, le=65536, description="global batch size in windows, summed over workers"
    )
    lr: float = Field(0.003, gt=0, le=1, description="AdamW learning rate")
    block_size: int = Field(64, ge=2, le=1024, description="characters per training window (context length)")
    d_model: int = Field(64, ge=4, le=1024, description="width of the residual stream")
    layers: int = Field(2, ge=1, le=12, description="transformer layers")
    heads: int = Field(4, ge=1, le=32, description="attention heads per layer; must divide d_model")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharTransformerHyperparameters:
        if self.d_model % self.heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        return self
