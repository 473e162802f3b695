"""The hyperparameters of the ResNet task. No torch here: Bungee's portal reads this schema to
validate a submitted job and to draw the form."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ResNetHyperparameters(BaseModel):
    """A CIFAR-style ResNet-18 (11.2M parameters at width 64) on synthetic 3x32x32 images."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(128, ge=1, le=65536, description="global batch size, summed over workers")
    lr: float = Field(0.1, gt=0, le=10, description="learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(5e-4, ge=0, le=1, description="SGD weight decay")
    width: int = Field(64, ge=1, le=512, description="channels of the first stage (the others have 2, 4 and 8 times as many)")
    images: int = Field(50_000, ge=1, le=10_000_000, description="training images")
