"""The character transformer's hyperparameters. No torch here: Bungee's portal reads this
schema to validate a submitted job and to draw the form."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CharTransformerHyperparameters(BaseModel):
    """A causal transformer language model over characters, trained by AdamW."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(32, ge=1, le=65536, description="global batch size in windows, summed over workers")
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
