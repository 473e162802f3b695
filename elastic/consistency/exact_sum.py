"""A gradient sum whose result does not depend on how the summands are grouped.

Floating-point addition is not associative: an all-reduce over 4 workers and one over 2 workers
(each accumulating two virtual workers) add the same numbers in different orders and round
differently, so parameters drift apart bit by bit. Integers do add associatively. Each virtual
worker's gradient is therefore turned into 64-bit fixed point with one scale per tensor that
every worker agrees on (from the global largest magnitude), the integers are summed (locally,
then with an ordinary SUM all-reduce), and the exact total is turned back into floating point.
The result is a function of the set of virtual-worker gradients alone: the same on 1, 2, 3 or 4
workers, in any placement.

Cost: one small MAX all-reduce of per-tensor magnitudes, then one SUM all-reduce of int64 (twice
the bytes of a float32 all-reduce). Precision: the scale leaves `HEADROOM_BITS` bits for the sum
of up to `virtual_workers` terms, so each term keeps about 62 - log2(V) - HEADROOM_BITS bits
below its tensor's largest magnitude, far finer than float32's 24-bit mantissa for the large
entries; entries more than ~2^38 times smaller than the tensor's largest are rounded to zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

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


def to_fixed(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`tensor` in int64 fixed point at `scale` (rounded to nearest, ties to even)."""
    return torch.round(tensor.to(torch.float64) * scale).to(torch.int64)


def from_fixed(total: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (total.to(torch.float64) / scale).to(dtype)


class ExactGradientSum:
    """Sums gradients of virtual workers exactly, whatever their placement on physical workers.

    Per step: `add(vw_gradients)` for each virtual worker this process runs (any order), then
    `result(group)` all-reduces and returns the float totals. Two passes over the local terms
    are needed because the shared scale depends on every term's magnitude: the terms are kept
    (as float32) until `result`.
    """

    def __init__(self, virtual_workers: int) -> None:
        self.virtual_workers = virtual_workers
        self._terms: list[list[torch.Tensor]] = []

    def add(self, gradients: Sequence[torch.Tensor]) -> None:
        if self._terms and len(gradients) != len(self._terms[0]):
            raise ValueError(f"expected {len(self._terms[0])} gradient tensors, got {len(gradients)}")
        self._terms.append([g.detach().clone() for g in gradients])

    def result(self, group: dist.ProcessGroup | None = None, distributed: bool = True) -> list[torch.Tensor]:
        """The exact sum over every virtual worker of every process in `group`. Raises
        ValueError if this process added no term and has no shapes to contribute."""
        if not self._terms:
            raise ValueError("no gradients added: a process must host at least one virtual worker")
        terms, self._terms = self._terms, []
        count = len(terms[0])
        max_abs = torch.stack(
            [
                torch.stack(
                    [term[i].abs().max() if term[i].numel() else torch.zeros(()) for term in terms]
                ).max()
                for i in range(count)
            ]
        ).to(torch.float64)
        if distributed:
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=group)
        scales = tensor_scales(max_abs, self.virtual_workers)
        totals = []
        for i in range(count):
            total = torch.zeros(terms[0][i].shape, dtype=torch.int64)
            for term in terms:
                total += to_fixed(term[i], scales[i])
            totals.append(total)
        if distributed:
            flat = torch.cat([t.reshape(-1) for t in totals])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for t in totals:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return [from_fixed(total, scales[i], terms[0][i].dtype) for i, total in enumerate(totals)]
