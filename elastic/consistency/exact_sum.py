"""A gradient sum whose result does not depend on how the summands are grouped: the scales.

Floating-point addition is not associative: an all-reduce over 4 workers and one over 2 workers
(each accumulating two virtual workers) add the same numbers in different orders and round
differently, so parameters drift apart bit by bit. Integers do add associatively. Strict mode
(elastic.worker.strict) therefore turns each virtual worker's gradient into fixed point, one
power-of-two scale per tensor that every worker agrees on (from the global largest magnitude),
sums the integers (locally, then with an ordinary SUM all-reduce), and turns the exact total back
into floating point. The result is a function of the set of virtual-worker gradients alone: the
same on 1, 2, 3 or 4 workers, in any placement.

This module says how large a scale may be: it leaves `HEADROOM_BITS` bits for the sum of up to
`virtual_workers` terms, so each term keeps `spare_bits` bits below its tensor's largest
magnitude (28 with 2 virtual workers in int32, 60 in int64); entries smaller than the largest by
more than that are truncated to zero.
"""

from __future__ import annotations

import math

import torch

INT_BITS = 63
HEADROOM_BITS = 1


def spare_bits(virtual_workers: int, int_bits: int = INT_BITS) -> int:
    """Bits of fixed point each of `virtual_workers` terms keeps below its tensor's largest
    magnitude, in a signed integer of `int_bits` value bits (63 for int64, 31 for int32)."""
    if virtual_workers < 1:
        raise ValueError(f"virtual_workers must be at least 1, not {virtual_workers}")
    return int_bits - HEADROOM_BITS - math.ceil(math.log2(virtual_workers)) - 1


def tensor_scales(max_abs: torch.Tensor, virtual_workers: int, int_bits: int = INT_BITS) -> torch.Tensor:
    """Per-tensor power-of-two scales (float64) such that the sum of `virtual_workers` terms,
    each at most `max_abs` in magnitude after scaling, fits in a signed integer of `int_bits`
    value bits (int64 by default). A zero tensor gets 1."""
    spare = spare_bits(virtual_workers, int_bits)
    exponents = torch.where(
        max_abs > 0,
        spare - torch.ceil(torch.log2(max_abs.to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny))),
        torch.zeros_like(max_abs, dtype=torch.float64),
    )
    return torch.exp2(exponents)
