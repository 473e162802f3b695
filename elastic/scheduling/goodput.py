"""What a larger global batch is worth: statistical efficiency from gradient noise.

A step at batch M averages M per-sample gradients. While the gradient noise is large compared to
the gradient itself, doubling M nearly halves the steps a job needs; once the noise is small,
a larger batch only costs time. With |G|^2 the squared norm of the true gradient and V the
variance of the gradient measured at the base batch M0, a step at M does the work of

    gain(M) = (V + |G|^2) / (V * M0 / M + |G|^2)

steps at M0: M / M0 when noise dominates, 1 when it vanishes. Progress is counted in those
base-batch steps, so a job's rate of progress is gain(M) divided by its step time at M; that
product of system throughput and statistical efficiency is its goodput.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GradientNoise:
    """Gradient statistics at one point of training, in units of the base batch size."""

    base_batch_size: int
    grad_sqr: float
    """Squared norm of the (estimated) true gradient."""
    grad_var: float
    """Variance of the gradient estimate at the base batch size (trace of its covariance)."""

    def __post_init__(self) -> None:
        if self.base_batch_size < 1 or self.grad_sqr < 0 or self.grad_var < 0:
            raise ValueError(
                f"invalid gradient statistics: base_batch_size={self.base_batch_size!r}, "
                f"grad_sqr={self.grad_sqr!r}, grad_var={self.grad_var!r}"
            )

    def gain(self, batch_size: np.ndarray | float) -> np.ndarray:
        """Base-batch steps one step at `batch_size` is worth (>= 1 above the base batch)."""
        scale = np.asarray(batch_size, dtype=float) / self.base_batch_size
        total = self.grad_var + self.grad_sqr
        if total <= 0:
            return scale
        # Multiplied through by the scale: V / scale underflows to 0 for a subnormal V, and with
        # |G|^2 = 0 the quotient of the formula as written would be infinite.
        return total * scale / (self.grad_var + self.grad_sqr * scale)

    def efficiency(self, batch_size: np.ndarray | float) -> np.ndarray:
        """Gain per sample relative to the base batch, in (0, 1]."""
        scale = np.asarray(batch_size, dtype=float) / self.base_batch_size
        return self.gain(batch_size) / scale
