"""The data-parallel step of a model sharded with fully_shard (elastic.worker.sharded).

FSDP gathers each unit's parameters for forward and backward and reduce-scatters each unit's
gradient as soon as backward has it, so no rank ever holds the whole gradient. The step keeps
the meaning of elastic.worker.trainer's: the gradient of the mean loss over the global batch,
each rank's term weighted by its share of the batch (shares may be uneven). FSDP's own
reduction can only average over the ranks, or divide afterwards by one factor, which is wrong
for uneven shares; so the reduce-scatter is ours (ShareScaledReduceScatter): it multiplies this
rank's unsharded gradient by its share, then sums. The step's statistics (loss, sample count,
votes, metrics) go in an all-reduce of their own after backward.

Every rank runs forward and backward every step (each unit's gathers and reduce-scatters are
collectives), so every rank needs at least one sample of the batch: a global batch smaller than
the world is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from elastic.worker.data import share_bounds
from elastic.worker.trainer import StepOutcome, SwitchVote, Trainer


class OwnReduceScatter(ReduceScatter):
    """A reduce-scatter of ours in FSDP's place (set_custom_reduce_scatter): its buffers are
    plain tensors; subclasses say what `__call__` sums and how."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ShareScaledReduceScatter(OwnReduceScatter):
    """A reduce-scatter (SUM) whose input, this rank's unsharded gradient of a unit, is first
    multiplied by `share`: the fraction of the global batch the rank trained on this step."""

    def __init__(self) -> None:
        self.share = 1.0

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.share != 1.0:  # x * 1.0 is x: a pass over the gradient saved
            input_tensor.mul_(self.share)
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The modules of `model` that fully_shard made units (the root among them)."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


class ShardedSteps(Trainer):
    """Trainer.step for a sharded model (see the module docstring); a trainer of a consistency
    mode takes it on as a mixin, before its own class. `adopt` gives it each generation's
    module."""

    _scatter: ShareScaledReduceScatter | None = None

    def adopt(self, module: torch.nn.Module) -> None:
        """Trains `module` (sharded over this generation's mesh) from now on: the task's loss
        sees it, its parameters are the ones stepped, and its units reduce-scatter through a
        ShareScaledReduceScatter. Raises ValueError if `module` is not sharded."""
        units = fsdp_modules(module)
        if not units:
            raise ValueError("the module is not sharded: fully_shard it first (elastic.worker.sharded.shard)")
        self._scatter = ShareScaledReduceScatter()
        for unit in units:
            unit.set_custom_reduce_scatter(self._scatter)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.problem.model = module
        self._parameters = [p for p in module.parameters() if p.requires_grad]
        self._listed_buffers = None  # the module's buffers are new tensors

    def step(self, step: int, stop_requested: bool, switch_to: SwitchVote = 0) -> StepOutcome:
        if self._scatter is None:
            raise RuntimeError("adopt must give the trainer its sharded module before the first step")
        if self.batch_size < self.world_size:  # every rank sees it: none enters the collectives
            raise ValueError(
                f"a sharded job needs a sample for every worker: a global batch of {self.batch_size} "
                f"over {self.world_size} workers leaves some none"
            )
        start, stop = share_bounds(self.batch_size, self.world_size, self.rank)
        self._scatter.share = (stop - start) / self.batch_size
        return super().step(step, stop_requested, switch_to)

    def _fresh_gradients(self) -> torch.Tensor | None:
        """No buffer of the whole gradient: FSDP leaves each parameter's reduced shard in its
        `grad`, so the gradients are let go before backward."""
        for parameter in self._parameters:
            parameter.grad = None
        return None

    def _sum_statistics(self, stats: torch.Tensor) -> None:
        """The statistics of the step, summed over the ranks (the gradients went with backward)."""
        self.reduce(stats)
