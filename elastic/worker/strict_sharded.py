"""Strict mode's exact gradient sum on a model sharded with fully_shard: a first version, driven
by tests and not by the worker yet.

Strict mode (elastic.worker.strict) sums V virtual workers' gradients in fixed point, so the
total does not depend on which worker ran which virtual worker. Sharded, each unit's gradient
is reduce-scattered as soon as backward has it, once per backward pass. So every worker runs one
pass per hosted virtual worker, and each pass's reduce-scatter is of integers
(ExactReduceScatter): the unit's term (the pass's gradient times the virtual worker's share of
the batch) times a power-of-two scale, truncated to int64, summed over the workers; each
worker adds the sums of its passes in int64, and after the last one turns the exact total back
into floating point, which FSDP puts in the parameters' gradients. Integer sums do not depend
on their order, so a parameter's gradient is the same bits on any placement, and (per-element
optimiser updates not depending on the cut either: tests/test_sharding_optimizer_layout.py)
so is every step.

The scale of a unit must be agreed before its first term is cut. As strict mode does
(elastic.worker.strict), a step predicts it from the largest term of the last step (agreed over
the workers), loosened by MARGIN_BITS; every pass notes its largest terms, and one MAX all-reduce
after the passes says whether the prediction held: no term over the integers' range, and none
of the unit's terms more than 2 * MARGIN_BITS bits below where the step's own largest term
would have put them. Otherwise the step is done again with scales from its own largest terms
(the passes twice), as is the first step, which has nothing to predict from. The prediction and
the decision depend only on the agreed largest terms, so on no placement; the largest terms
travel with the contexts to joiners (`carried`, `share_carried`).

Buffers (batch-norm statistics) are per virtual worker, as in strict mode: each worker keeps
every virtual worker's copy (its context), loads a virtual worker's before its passes, keeps what
its summing pass leaves, and after the step the contexts are summed over the workers, each
writing only its own virtual workers' rows (x + 0 is x), so every worker holds all of them; the
module's own buffers then hold virtual worker 0's. A joiner takes them from a holder
(`share_carried`).

What this version leaves out, refused: placements where workers host different numbers of
virtual workers (the passes, which are collectives, would not match). The step's loss is
averaged in floating point, for reporting only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.consistency.exact_sum import tensor_scales
from elastic.tasks.runtime import BoundTask
from elastic.worker.data import SampleStream, seed_torch, share_bounds
from elastic.worker.sharded_step import OwnReduceScatter, fsdp_modules
from elastic.worker.strict import virtual_worker_seed

MARGIN_BITS = 8
"""How far (in bits) a unit's largest term may grow beyond the last step's, or shrink below it
twice as far, before a step's predicted scale is rejected: int64's margin in strict mode."""


@dataclass
class Carried:
    """What a strict sharded worker carries between generations (and a holder hands a joiner)."""

    contexts: list[torch.Tensor]
    last_max_abs: list[float] | None


class ExactReduceScatter(OwnReduceScatter):
    """One unit's gradient reduction in fixed point (see the module docstring). Between passes
    the owner sets `share` (the pass's virtual worker's share of the batch) and `final`; before
    the summing passes, `scale`. `measuring` passes only note `max_abs`."""

    def __init__(self) -> None:
        self.share = 1.0
        self.measuring = True
        self.final = False
        self.max_abs = 0.0
        self.scale = 1.0
        self._total: torch.Tensor | None = None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        self._reduce(output_tensor, input_tensor, group)
        return None

    def alone(self, output: torch.Tensor) -> None:
        """FSDP's hook after the reduction, used in a group of one, where FSDP calls no
        reduce-scatter: `output` holds the pass's own unit gradient."""
        self._reduce(output, output.clone(), None)

    def _reduce(self, output: torch.Tensor, unsharded: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        term = unsharded.mul_(self.share)  # rounded once, the same bits on any placement
        if term.numel():
            self.max_abs = max(self.max_abs, float(term.abs().max()))
        if self.measuring:
            output.zero_()
            return
        fixed = term.mul_(self.scale).to(torch.int64)  # a power of two: exact; then truncated
        if group is None:
            summed = fixed
        else:
            summed = torch.empty(output.shape, dtype=torch.int64, device=output.device)
            dist.reduce_scatter_tensor(summed, fixed, op=dist.ReduceOp.SUM, group=group)
        self._total = summed if self._total is None else self._total.add_(summed)
        if not self.final:
            output.zero_()
            return
        output.copy_(self._total.to(torch.float64).div_(self.scale))
        self._total = None


class ExactShardedStep:
    """Trains a sharded `module` (elastic.worker.sharded) in strict mode with V
    `virtual_workers`, this worker hosting `hosted` of them, over `group` (the module's mesh's;
    the default group if None). What a survivor carries from its last generation (`carried`:
    the contexts and the last largest terms) goes on; else every virtual worker's context starts
    as the module's buffers (a joiner then takes a holder's: share_carried). Raises ValueError if
    the workers would host different numbers of virtual workers."""

    def __init__(
        self,
        problem: BoundTask,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        stream: SampleStream,
        batch_size: int,
        seed: int,
        virtual_workers: int,
        hosted: range,
        group: dist.ProcessGroup | None = None,
        carried: Carried | None = None,
        margin_bits: int = MARGIN_BITS,
    ) -> None:
        self.problem, self.module, self.optimizer, self.stream = problem, module, optimizer, stream
        self.batch_size, self.seed, self.virtual_workers, self.hosted = (
            batch_size,
            seed,
            virtual_workers,
            hosted,
        )
        self.group = group
        size = dist.get_world_size(group)
        if virtual_workers % size or len(hosted) != virtual_workers // size:
            raise ValueError(
                f"every worker must host the same number of the {virtual_workers} virtual workers "
                f"({size} workers); this one hosts {len(hosted)}"
            )
        self.comms: list[ExactReduceScatter] = []
        for unit in fsdp_modules(module):
            comm = ExactReduceScatter()
            unit.set_custom_reduce_scatter(comm)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            if size == 1:
                unit.set_all_reduce_hook(comm.alone)
            self.comms.append(comm)
        problem.model = module
        self.buffers = [buffer for buffer in module.buffers()]
        self.margin_bits = margin_bits
        self.contexts = (
            carried.contexts
            if carried is not None
            else [
                buffer.detach().unsqueeze(0).repeat(virtual_workers, *([1] * buffer.dim()))
                for buffer in self.buffers
            ]
        )
        """One tensor per buffer: row k is virtual worker k's copy."""
        self.last_max_abs = carried.last_max_abs if carried is not None else None
        """Each unit's largest term of the last step, agreed; None before the first."""
        self.rejected_steps = 0
        """Steps whose predicted scales did not hold, done again."""
        self._load_context(0)

    def carried(self) -> Carried:
        """What goes on into the next generation: the contexts and the last largest terms."""
        return Carried(self.contexts, self.last_max_abs)

    def share_carried(self, source: int) -> None:
        """Every worker of the group takes what group rank `source` (a holder) carries, and the
        module's buffers virtual worker 0's context. A collective call."""
        for context in self.contexts:
            dist.broadcast(context, group=self.group, group_src=source)
        known = torch.full((1 + len(self.comms),), math.nan, dtype=torch.float64)
        if self.last_max_abs is not None:
            known[1:] = torch.tensor(self.last_max_abs, dtype=torch.float64)
            known[0] = 1.0
        dist.broadcast(known, group=self.group, group_src=source)
        self.last_max_abs = known[1:].tolist() if known[0] == 1.0 else None
        self._load_context(0)

    def _load_context(self, virtual_worker: int) -> None:
        with torch.no_grad():
            for buffer, context in zip(self.buffers, self.contexts, strict=True):
                buffer.copy_(context[virtual_worker])

    def _keep_context(self, virtual_worker: int) -> None:
        with torch.no_grad():
            for buffer, context in zip(self.buffers, self.contexts, strict=True):
                context[virtual_worker].copy_(buffer)

    def _sum_contexts(self) -> None:
        """Every worker's rows of the contexts to every worker: the others' rows zeroed, then a
        SUM (x + 0 is x, in floating point as in integers)."""
        mine = torch.zeros(self.virtual_workers, dtype=torch.bool)
        mine[self.hosted.start : self.hosted.stop] = True
        for context in self.contexts:
            context[~mine] = 0
            dist.all_reduce(context, group=self.group)
        self._load_context(0)

    def step(self, step: int) -> float:
        """Trains 0-based step `step` and returns the mean loss over the global batch (floating
        point, for reporting). A collective call."""
        first = step * self.batch_size
        positions = self.stream.positions(first, first + self.batch_size)
        slices = [share_bounds(self.batch_size, self.virtual_workers, k) for k in self.hosted]
        if self.last_max_abs is None:  # nothing to predict from: measure first
            self._set(measuring=True)
            self._passes(step, positions, slices)
            scales = tensor_scales(self._agreed_max_abs(), self.virtual_workers)
        else:
            loosened = torch.tensor(self.last_max_abs, dtype=torch.float64) * 2.0**self.margin_bits
            scales = tensor_scales(loosened, self.virtual_workers)
        kept = [context.clone() for context in self.contexts]
        self._set(measuring=False, scales=scales)
        loss = self._passes(step, positions, slices, keep=True)
        largest = self._agreed_max_abs()
        own = tensor_scales(largest, self.virtual_workers)
        held = bool(((scales <= own) & (scales * 2.0 ** (2 * self.margin_bits) >= own)).all())
        if not held:  # again, with the scales of this step's own largest terms
            self.rejected_steps += 1
            for context, before in zip(self.contexts, kept, strict=True):
                context.copy_(before)
            self._set(measuring=False, scales=own)
            loss = self._passes(step, positions, slices, keep=True)
        self.last_max_abs = largest.tolist()
        self.optimizer.step()
        if self.contexts:
            self._sum_contexts()
        for parameter in self.module.parameters():
            parameter.grad = None
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    def _set(self, measuring: bool, scales: torch.Tensor | None = None) -> None:
        """Readies every unit's reduce-scatter for a round of passes."""
        for index, comm in enumerate(self.comms):
            comm.measuring, comm.max_abs = measuring, 0.0
            if scales is not None:
                comm.scale = float(scales[index])

    def _agreed_max_abs(self) -> torch.Tensor:
        """Each unit's largest term of the round just done, over all the workers."""
        maxima = torch.tensor([comm.max_abs for comm in self.comms], dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        return maxima

    def _passes(
        self, step: int, positions: torch.Tensor, slices: list[tuple[int, int]], keep: bool = False
    ) -> float:
        """One forward and backward pass per hosted virtual worker, each in its context (kept
        afterwards if `keep`); returns the sum of their losses times their shares."""
        for parameter in self.module.parameters():
            parameter.grad = None
        weighted = 0.0
        for index, (k, (start, stop)) in enumerate(zip(self.hosted, slices, strict=True)):
            share = (stop - start) / self.batch_size
            for comm in self.comms:
                comm.share, comm.final = share, index == len(slices) - 1
            self._load_context(k)
            seed_torch(virtual_worker_seed(self.seed, step, k), torch.device("cpu"))
            loss = self.problem.loss(self.problem.batch(positions[start:stop]))
            loss.backward()
            if keep:
                self._keep_context(k)
            weighted += float(loss.detach()) * share
        return weighted
