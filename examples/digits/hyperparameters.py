"""The hyperparameters of the two digits tasks. No torch here: Bungee's portal reads these
schemas to validate a submitted job and to draw the form."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DigitsHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(64, ge=1, le=65536, description="global batch size, summed over workers")
    lr: float = Field(0.05, gt=0, le=10, description="learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")


class DigitsMLPHyperparameters(DigitsHyperparameters):
    """An MLP with `layers` hidden layers (one by default), trained by SGD with momentum."""

    hidden: int = Field(64, ge=1, le=4096, description="width of each hidden layer")
    layers: int = Field(
        1, ge=1, le=16, description="hidden layers (7 layers of 2060 make a 25.6M-parameter model)"
    )
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout probability after the hidden layer")


class DigitsCNNHyperparameters(DigitsHyperparameters):
    """Two convolutions with batch norm, then dropout and a linear classifier, trained by SGD."""

    channels: int = Field(
        16, ge=1, le=256, description="channels of the first convolution (the second has twice as many)"
    )
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout probability before the classifier")
