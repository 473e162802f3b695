"""Strict mode: a job of V virtual workers whose training does not depend on where they run.

Each virtual worker (vw) k trains, at step s, on a fixed slice of the global batch (slice k of V
of the stream positions of step s), with its random generators (torch, numpy, Python) seeded
from (job seed, s, k), and with its own copy of the model's per-replica state (buffers, such as
batch-norm running statistics), its *context*. A physical worker runs its contiguous share of
vws one after the other: load vw k's context into the model, seed, forward and backward, keep
the gradient, save the context back. Nothing of a vw's computation depends on the worker it
runs on, so each vw's gradient is the same bits on any placement.

The gradients are then summed exactly (elastic.consistency.exact_sum: fixed point with a
per-tensor scale from a MAX all-reduce; int32, the bytes of a float32 all-reduce, while it keeps
24 bits below each tensor's largest entry, that is up to 32 virtual workers, else int64), so
their total is the same bits whatever the grouping;
so is the loss, summed the same way. The scales are powers of two, so the conversion runs in
the gradients' own dtype, exactly, rather than through float64, and the step's buffers are kept
from one step to the next. Every parameter update is therefore placement-independent.

Predicted scales: the MAX all-reduce is a second round trip a step. After a step that took it,
the next steps use its scales loosened by a margin of M bits each way (up to
MAX_SCALE_MARGIN_BITS) without it, and every rank votes in the SUM all-reduce whether its terms
fit them: none over the integers' range, and in each segment that is not all zeros some term
that keeps MIN_SPARE_BITS. If any vote fails, every rank takes the MAX all-reduce and a second
SUM of the gradients for that step, with what the MAX gives, and predicts again from it. The
scales a step uses are thus a function of the committed steps alone, the same on every
placement; they are state (small_state), carried to joiners and checkpoints.

int32 or int64: int32 leaves a term 29 - ceil(log2 V) bits, of which 24 are the floor, so M is 2
bits with 1 or 2 virtual workers, 1 with 3 to 8, and 0 (no prediction: every step takes the MAX
all-reduce) with 9 to 32; int64 leaves M = 8. A segment's largest gradient moves by more than a
bit or two from step to step on small models and small per-vw batches (the noisy test task, the
ResNet-style example at width 8: up to 6 bits), and one segment out of range rejects the step:
int32 predictions were rejected in 10-72% of 60 steps at 1 to 8 virtual workers there, 2-7% on
the digits MLP (bench/results/strict-fallbacks-cpu-2core-2026-11-26.txt). The trade-off, with
B the bytes of an int32 SUM and L what a rejection adds besides bytes (the MAX round trip, two host
reads that drain a GPU's queue, a second scaling pass): int32 costs B + r(B + L) a step at a
rejection rate r, int64 2B, so int64 is cheaper once r > B / (B + L): on one node, where L is
milliseconds of host syncs and B a fraction of one, from r of about 0.2-0.3; across a slow
network, where B dominates, only as r nears 1; with one worker (no all-reduce: B is 0) at any r.
A job therefore starts in int32 and, once WIDEN_AFTER_REJECTIONS of the last WIDEN_WINDOW steps
that tried predictions rejected them (a rate of one half), sums in int64 for the rest of its
life: its next step takes the MAX all-reduce for int64's scales, and the predictions then hold
(medians, simulated: a rate of 0.5 switches in about 7 predicted steps, 0.3 in 19, 0.2 in 50,
0.1 in 370, 0.05 in thousands: a job whose rejections are rare stays in int32). Measured over 60
steps: the jobs that switched fell back in 7-12% of steps, all before the switch (none in the
second half); those at 2 virtual workers (10% and 22%) and the digits MLP stayed in int32. The
switch is taken from the agreed votes of committed steps (recent_rejections) and is state, as
the scales: it happens at the same step on every placement and travels to joiners and
checkpoints.

Contexts and crashes: the contexts of all V vws ride in the step's SUM all-reduce, each
worker writing the rows of the vws it hosts and zeros elsewhere (x + 0 = x in integers, so the
rows arrive unchanged). After every step each worker thus holds every vw's context, committed
only when the all-reduce succeeded, in the same step as the parameters. A vw whose worker dies
loses nothing: any survivor holds its context as of the last completed step, and it travels to
joiners with the rest of the state (Trainer.bulk_state) and into the periodic checkpoint. The
model's own buffers hold vw 0's context between steps (the model a checkpoint or an evaluation
sees, as plain DDP's rank 0). The cost is V times the buffers' bytes per step, small next to the
gradients for the usual models (batch norm keeps two values per channel).

Reads from the device (each a sync on a GPU): a step whose predicted scales hold reads once, after
its SUM: the loss's and metrics' fixed-point sums, the agreed values and the votes together, the
loss and metrics then computed on the host exactly as on the device. On a GPU
(votes_on_device) the votes on the predicted scales and on a step that is not finite are taken
on the device: a term over the range leaves its row unscaled (a factor of 1 per segment, chosen
there) and its integers zeroed, as the host's vote does. On a CPU, where a read costs nothing,
the host votes from a read of the magnitudes before the collectives (two reads), sparing the
full-width scaling pass. A step that takes the MAX all-reduce reads its result (the scales are
computed on the host), and one whose prediction is rejected reads the sums again.
"""

from __future__ import annotations

import math
import random
from typing import Any, Unpack

import numpy
import torch
import torch.distributed as dist

from elastic.consistency.exact_sum import spare_bits, tensor_scales
from elastic.consistency.placement import check_shares, even_shares, hosted
from elastic.tasks.runtime import BoundTask
from elastic.worker.data import SampleStream, derive_seed, seed_torch, share_bounds
from elastic.worker.readahead import Share
from elastic.worker.trainer import (
    METRIC_SLOTS,
    CollectiveError,
    NonFiniteLossError,
    StepOutcome,
    SwitchVote,
    Trainer,
    TrainerOptions,
    all_reduce,
    names_fingerprint,
    vote,
)

_COUNT, _STOP_VOTES, _SWITCH_TO, _NONFINITE_VOTES, _METRIC_NAMES = 0, 1, 2, 3, 4
_STATS = 5
MIN_SPARE_BITS = 24
"""Fixed-point bits a term must keep below its tensor's largest magnitude: a float32's."""
MAX_SCALE_MARGIN_BITS = 8
"""The most a predicted scale leaves for a segment's magnitude to grow (and to shrink) before the
step falls back to the MAX all-reduce."""
WIDEN_WINDOW = 8
WIDEN_AFTER_REJECTIONS = 4
"""A job in int32 whose predicted scales were rejected in this many of the last WIDEN_WINDOW
steps that tried them (half) sums in int64 from its next step on (see the module's docstring)."""
_VOTES = 3  # per segment: terms over the predicted range, terms within its low end, nonzero terms


def _starts_wide(virtual_workers: int) -> bool:
    """Whether a job of `virtual_workers` sums in int64 from its first step: int32 would keep
    fewer than MIN_SPARE_BITS below a tensor's largest term (more than 32 virtual workers)."""
    return spare_bits(virtual_workers, 31) < MIN_SPARE_BITS


def virtual_worker_seed(seed: int, step: int, virtual_worker: int) -> int:
    """The seed of every random generator of virtual worker `virtual_worker` at step `step`."""
    return derive_seed(seed, step, virtual_worker, 0x5717)


def _byte_views(buffers: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each of `buffers` as a flat uint8 view of its bytes, or None if one is not contiguous (its
    flat view would be a copy, which a write would not reach)."""
    if not all(buffer.is_contiguous() for buffer in buffers):
        return None
    return [buffer.detach().view(-1).view(torch.uint8) for buffer in buffers]


class StrictTrainer(Trainer):
    """Trains `problem` with `virtual_workers` virtual workers, this process hosting its share."""

    def __init__(
        self,
        problem: BoundTask,
        optimizer: torch.optim.Optimizer,
        stream: SampleStream,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        virtual_workers: int,
        **options: Unpack[TrainerOptions],
    ) -> None:
        super().__init__(problem, optimizer, stream, batch_size, seed, rank, world_size, **options)
        if not 1 <= virtual_workers <= batch_size:
            raise ValueError(f"virtual_workers ({virtual_workers}) must be in 1..batch_size ({batch_size})")
        self.virtual_workers = virtual_workers
        self._model_buffers = [buffer for _, buffer in problem.model.named_buffers()]
        context_bytes = sum(b.numel() * b.element_size() for b in self._model_buffers)
        self._context_bytes = context_bytes
        self._buffer_bytes = _byte_views(self._model_buffers)
        """Each buffer's bytes as a flat uint8 view of it, made once (None: some buffer is not
        contiguous, so it has no such view and contexts are copied buffer by buffer)."""
        self._buffer_sizes = [view.numel() for view in self._buffer_bytes or []]
        words = math.ceil(context_bytes / 8)
        self.contexts = torch.zeros(virtual_workers, words, dtype=torch.int64, device=self._device)
        """Every vw's context after the last completed step, as int64 words."""
        if words:
            self.contexts[:] = self._pack()
        # The segments after the gradients: the loss, then the named metrics (one segment, one
        # scale: they are reported, never trained on).
        sizes = [p.numel() for p in self._parameters] + [1, METRIC_SLOTS]
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        self._bounds = [(end - size, end) for size, end in zip(sizes, ends, strict=True)]
        """[begin, stop) of each parameter's gradient, then of the loss and of the metrics, in a
        row of terms."""
        self._row_width = ends[-1]
        self._segment_sizes = torch.tensor(sizes, device=self._device)
        self.votes_on_device = self._device.type != "cpu"
        """Whether the votes on predicted scales and on a step that is not finite are taken on
        the device, sparing the read before the collectives (a sync on a GPU): a step whose
        predicted scales hold then reads the device once. On a CPU a read costs nothing, and
        the host's votes spare the full-width scaling pass this needs."""
        self._extremes = (
            torch.zeros(len(sizes), dtype=self._dtype, device=self._device),
            torch.zeros(len(sizes), dtype=self._dtype, device=self._device),
        )
        """Each segment's smallest and largest term, written in place every step (CPU)."""
        self._terms: torch.Tensor | None = None
        self._views_at: dict[int, list[torch.Tensor]] = {}
        """Gradient views of the step's rows by their address (_point_gradients_at), dropped
        with the rows they view."""
        self._segments_at: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        """Segment views of the rows by their address and dtype (_segments), dropped with them."""
        self.predicted_scales: list[float] | None = None
        """The scales the next step tries without the MAX all-reduce; a function of the committed
        steps alone, so the same on every worker and in the state a joiner or a checkpoint gets."""
        self.scale_fallbacks = 0
        """Steps whose predicted scales every worker rejected (then the MAX all-reduce ran)."""
        self.recent_rejections: list[bool] = []
        """Whether each of the last WIDEN_WINDOW steps that tried predicted scales rejected them
        (committed steps only, agreed by every worker: state, as the scales)."""
        self._votes_at = ends[-1] + _STATS
        self._set_fixed_point(wide=_starts_wide(virtual_workers))
        self._result: torch.Tensor | None = None
        """The step's exact sum, as floats, for a worker that hosts no vw (else the first row of
        the terms holds it: see _result_row)."""
        self.hosted = range(0)
        self.rebind(rank, world_size)

    def _set_fixed_point(self, wide: bool) -> None:
        """Sums in int64 (`wide`) or int32 from now on: the predicted scales' margin, the range
        they are voted on, and the SUM buffer (fixed-point sums, votes, contexts) follow."""
        self.wide_fixed_point = wide
        """Whether the fixed point is int64: from the start with more than 32 virtual workers
        (int32 would keep fewer than MIN_SPARE_BITS), or after predictions in int32 failed
        (WIDEN_AFTER_REJECTIONS); never int32 again."""
        self._fixed, self._int_bits = (torch.int64, 63) if wide else (torch.int32, 31)
        spare = spare_bits(self.virtual_workers, self._int_bits)
        self._margin_bits = min((spare - MIN_SPARE_BITS) // 2, MAX_SCALE_MARGIN_BITS)
        """How far a segment's magnitude may grow, and shrink, under a predicted scale (0: no
        prediction, every step takes the MAX all-reduce: so with 9 to 32 virtual workers in
        int32)."""
        self._highest_scaled = 2.0**spare
        self._lowest_scaled = 2.0 ** (spare - 2 * self._margin_bits - 1)
        per_word = 8 // self._fixed.itemsize
        self._contexts_at = math.ceil((self._votes_at + _VOTES * len(self._bounds)) / per_word) * per_word
        """Where the contexts start in the SUM buffer, on an 8-byte boundary."""
        self._total = torch.zeros(
            self._contexts_at + self.virtual_workers * self.contexts.shape[1] * per_word,
            dtype=self._fixed,
            device=self._device,
        )

    @property
    def fixed_dtype(self) -> torch.dtype:
        """The integers the step's SUM all-reduce adds: torch.int32 or torch.int64."""
        return self._fixed

    # --- placement ---------------------------------------------------------------------------

    def rebind(self, rank: int, world_size: int, shares: list[int] | None = None) -> None:
        """Host, from now on, rank `rank`'s share of `shares` (even shares if None). Raises
        ValueError if the shares do not place every virtual worker on `world_size` ranks."""
        shares = shares if shares is not None else even_shares(self.virtual_workers, world_size)
        check_shares(shares, self.virtual_workers, world_size)
        super().rebind(rank, world_size)
        self.shares = list(shares)
        self.hosted = hosted(shares, rank)

    def rebind_members(self, rank: int, world_size: int, shares: list[int] | None, step: int) -> None:
        self.rebind(rank, world_size, shares)

    def shares_ahead(self, step: int) -> list[Share]:
        first = self.next_batch_start(step)
        ahead = []
        for vw in self.hosted:
            start, stop = share_bounds(self.batch_size, self.virtual_workers, vw)
            indices = self.stream.positions(first + start, first + stop)
            seed = virtual_worker_seed(self.seed, step + 1, vw)
            ahead.append(Share(tuple(indices.tolist()), self.item_seeds(first + start, stop - start), seed, True))
        return ahead

    # --- contexts ----------------------------------------------------------------------------

    def _pack(self) -> torch.Tensor:
        """The model's buffers as one row of int64 words (bytes padded to a multiple of 8)."""
        pieces = list(self._buffer_bytes) if self._buffer_bytes is not None else [
            b.detach().reshape(-1).view(torch.uint8) for b in self._model_buffers
        ]  # fmt: skip
        padding = self.contexts.shape[1] * 8 - self._context_bytes
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.uint8, device=self._device))
        return torch.cat(pieces).view(torch.int64)

    def _unpack(self, row: torch.Tensor) -> None:
        """Loads a context row into the model's buffers: in one multi-tensor copy of their bytes
        (a copy a buffer was 60 kernels on a GPU for the ResNet example's batch norms, and 177 us
        of host time on a CPU core against 38)."""
        raw = row.view(torch.uint8)[: self._context_bytes]
        if self._buffer_bytes is not None:
            if self._buffer_bytes:
                torch._foreach_copy_(self._buffer_bytes, raw.split(self._buffer_sizes))
            return
        offset = 0
        for buffer in self._model_buffers:  # into each buffer itself: a flat view of one that is
            size = buffer.numel() * buffer.element_size()  # not contiguous is a copy of it
            values = raw[offset : offset + size].clone().view(buffer.dtype).view(buffer.shape)
            buffer.detach().copy_(values)
            offset += size

    def bulk_state(self) -> list[torch.Tensor]:
        return [self.contexts] if self.contexts.numel() else []

    def state_arrived(self) -> None:
        if self.contexts.numel():
            self._unpack(self.contexts[0])

    def small_state(self) -> dict[str, Any]:
        return {
            **super().small_state(),
            "virtual_workers": self.virtual_workers,
            "predicted_scales": None if self.predicted_scales is None else list(self.predicted_scales),
            "wide_fixed_point": self.wide_fixed_point,
            "recent_rejections": list(self.recent_rejections),
        }

    def load_small_state(self, state: dict[str, Any]) -> None:
        if state.get("virtual_workers", self.virtual_workers) != self.virtual_workers:  # refused before any change
            raise ValueError(
                f"the state is of {state['virtual_workers']} virtual workers, this job has {self.virtual_workers}"
            )
        super().load_small_state(state)
        carried = state.get("predicted_scales")
        self.predicted_scales = None if carried is None else [float(scale) for scale in carried]
        # A state from before int64 could be chosen on the way: the job's first fixed point.
        wide = bool(state.get("wide_fixed_point", _starts_wide(self.virtual_workers)))
        if wide != self.wide_fixed_point:
            self._set_fixed_point(wide)
        self.recent_rejections = [bool(rejected) for rejected in state.get("recent_rejections", [])]

    # --- the step ----------------------------------------------------------------------------

    def step(self, step: int, stop_requested: bool, switch_to: SwitchVote = 0) -> StepOutcome:
        """Trains 0-based step `step` with this process's virtual workers and returns what all
        ranks agree on; a collective call. Raises CollectiveError if a peer fails or times out:
        then nothing of the step is applied (parameters, optimiser, contexts)."""
        virtual, batch = self.virtual_workers, self.batch_size
        g, width = self._gradient_size, self._row_width  # the gradients, the loss, the metrics
        terms, total = self._step_buffers()
        words = self.contexts.shape[1]
        stats = total[width : width + _STATS]
        outgoing = total[self._contexts_at :].view(torch.int64).view(virtual, words)
        total[width:].zero_()
        first = self.batch_start(step)
        trained = []
        reading_ahead = False
        shares = [0.0] * len(terms)  # each row's share of the batch, applied with the scales
        for row, vw in enumerate(self.hosted):
            start, stop = share_bounds(batch, virtual, vw)
            indices = self.stream.positions(first + start, first + stop)
            trained.append(indices)
            if words:
                outgoing[vw] = self.contexts[vw]
            if not len(indices):
                continue
            self._point_gradients_at(terms[row, :g])
            if words:
                self._unpack(self.contexts[vw])
            vw_seed = virtual_worker_seed(self.seed, step, vw)
            seed_torch(vw_seed, self._device)
            numpy.random.seed(vw_seed)
            random.seed(vw_seed)
            try:
                items = self.readahead.batch(indices, self.item_seeds(first + start, len(indices)), vw_seed, True)
                if not reading_ahead:  # the next step's items, once this step's first are in
                    self.start_reading_ahead(step)
                    reading_ahead = True
                loss = self.problem.loss(items)
                loss.backward()
            except BaseException:  # the task's own error: the model's buffers back to vw 0's
                self.state_arrived()
                raise
            share = shares[row] = len(indices) / batch
            terms[row, g] = loss.detach() * share
            names = self.metric_names()
            if names:
                terms[row, g + 1 : g + 1 + len(names)] = self.metric_terms(names, share)
            if words:
                outgoing[vw] = self._pack()
        if not reading_ahead:
            self.start_reading_ahead(step)
        max_abs = self._segment_max_abs(terms, shares)
        self.readahead.prepare()  # the next step's items, while the device computes this one's
        nonfinite: bool | torch.Tensor
        if self.votes_on_device:
            # No read before the collectives: a step that is not finite is voted on from the
            # device (its integer sums are garbage, and every rank skips or fails it), and the
            # votes on predicted scales are computed there (_vote_on_device).
            nonfinite = ~torch.isfinite(max_abs).all()
            max_abs.masked_fill_(nonfinite, 0.0)
            magnitudes: list[float] = []
        else:
            # The step's first device-to-host read, before its collectives: the votes on
            # predicted scales and the skip of a step that is not finite are decided from it.
            magnitudes = self.to_host(max_abs)
            # A NaN or infinite loss or gradient here (NaN survives aminmax) is voted on; the terms
            # are zeroed so that the sums stay finite and every rank skips or fails the same step.
            nonfinite = not all(math.isfinite(magnitude) for magnitude in magnitudes)
            if nonfinite:
                terms.zero_()
                max_abs.zero_()
                magnitudes = [0.0] * len(magnitudes)
        if self.compute_done is not None:
            self.compute_done()
        predicted = self.predicted_scales
        tried = predicted is not None
        scaled_by: list[float] | None = None  # what the terms carry when a prediction is rejected
        over_here: torch.Tensor | None = None  # on the device: some term here is over (votes_on_device)
        votes = total[self._votes_at : self._votes_at + _VOTES * len(self._bounds)].view(_VOTES, -1)
        try:
            if predicted is None:
                all_reduce(max_abs, dist.ReduceOp.MAX)
                scales = self._scales(max_abs)
                self._to_fixed(terms, scales, shares, total[:width])
            elif self.votes_on_device:
                scales = predicted
                over_here = self._vote_on_device(max_abs, scales, votes)
                self._to_fixed(terms, scales, shares, total[:width], unless=over_here)
                scaled_by = predicted  # unless over_here: then the terms stay as they are
            else:
                scales = predicted
                over = self._vote(magnitudes, scales, votes)
                if over:  # every rank will reject the scales: the terms stay as they are
                    total[:width].zero_()
                else:
                    self._to_fixed(terms, scales, shares, total[:width])
                    scaled_by = predicted
            # fill_, not `stats[i] = number`: that copies from pageable host memory, a wait for
            # the whole step queued before it on a GPU (elastic.worker.trainer).
            stats[_COUNT].fill_(sum(len(indices) for indices in trained))
            stats[_STOP_VOTES].fill_(1 if stop_requested else 0)
            stats[_SWITCH_TO].fill_(vote(switch_to))
            if isinstance(nonfinite, torch.Tensor):
                stats[_NONFINITE_VOTES] = nonfinite
            else:
                stats[_NONFINITE_VOTES].fill_(int(nonfinite))
            stats[_METRIC_NAMES].fill_(names_fingerprint(self.metric_names()))
            all_reduce(total, dist.ReduceOp.SUM)
            # The second read: the loss's and metrics' integers, the agreed values, the votes.
            read = self.to_host(total[g : self._votes_at + votes.numel()])
            sums, agreed, voted = read[: width - g], read[width - g : width - g + _STATS], read[width - g + _STATS :]
            if predicted is not None and not self._accepted(voted):
                self.scale_fallbacks += 1
                all_reduce(max_abs, dist.ReduceOp.MAX)
                if over_here is not None:  # one read: the MAX, and whether the terms were scaled
                    read = self.to_host(torch.cat([max_abs, over_here.to(max_abs.dtype).reshape(1)]))
                    scales = self._scales_of(read[:-1])
                    scaled_by = None if read[-1] > 0 else scaled_by
                else:
                    scales = self._scales(max_abs)
                self._to_fixed(terms, scales, shares, total[:width], scaled_by)
                all_reduce(total[:width], dist.ReduceOp.SUM)
                predicted = None
                sums = self.to_host(total[g:width])  # a step that fell back reads them again
        except RuntimeError as err:  # what gloo and NCCL raise, DistBackendError included
            self.state_arrived()  # the model's buffers back to vw 0's committed context
            raise CollectiveError(f"the all-reduce of step {step} failed: {err}") from err
        try:
            skipped = self.nonfinite_agreed(step, agreed[_NONFINITE_VOTES])
        except NonFiniteLossError:
            self.state_arrived()
            raise
        if skipped:
            self.state_arrived()  # the model's buffers back to vw 0's committed context
            step_loss = math.nan
        else:
            exact = self._result_row(terms)
            exact.copy_(total[:width])  # integers to float, rounded once
            torch._foreach_mul_(self._segments(exact), [1.0 / scale for scale in scales])  # powers of two: exact
            self._point_gradients_at(exact[:g])
            self.optimizer.step()
            self.advance_schedule()
            if predicted is None and self._margin_bits:  # the MAX all-reduce's scales, loosened
                margin = 2.0**self._margin_bits
                self.predicted_scales = [scale / margin for scale in scales]
            if words:
                self.contexts.copy_(outgoing)
                self._unpack(self.contexts[0])
            # The loss and metrics as the device's rows would hold them (integers to the terms'
            # dtype, rounded once, times a power of two: exact), computed here from the read.
            loss_scale, metrics_scale = scales[len(self._parameters) :]
            reported = torch.tensor(sums, dtype=self._fixed).to(self._dtype)
            reported[:1].mul_(1.0 / loss_scale)
            reported[1:].mul_(1.0 / metrics_scale)
            step_loss = float(reported[0])
            metric_sums = reported[1:].tolist()  # weighted by share: they sum to 1 per batch
            self.agree_metrics(metric_sums, agreed[_METRIC_NAMES], agreed[_COUNT] / batch)
            if tried:
                self._count_prediction(rejected=predicted is None)
        outcome = StepOutcome(
            step=step + 1,
            loss=step_loss,
            samples=agreed[_COUNT],
            stop=agreed[_STOP_VOTES] > 0,
            switch_to=agreed[_SWITCH_TO],
            skipped=math.isnan(step_loss),
        )
        local = torch.cat(trained) if trained else torch.empty(0, dtype=torch.int64)
        self._committed(step, local, outcome)
        return outcome

    def _count_prediction(self, rejected: bool) -> None:
        """Counts a committed step that tried predicted scales; in int32, WIDEN_AFTER_REJECTIONS
        rejections among the last WIDEN_WINDOW make the fixed point int64 from the next step on
        (which takes the MAX all-reduce for int64's scales). Every worker counts the same
        agreed votes, so the switch happens at the same step on every placement."""
        if self.wide_fixed_point:  # never int32 again: nothing left to count
            return
        self.recent_rejections = [*self.recent_rejections, rejected][-WIDEN_WINDOW:]
        if sum(self.recent_rejections) >= WIDEN_AFTER_REJECTIONS:
            self._set_fixed_point(wide=True)
            self.predicted_scales = None
            self.recent_rejections = []

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's buffers, kept between steps so that a step faults in no memory: one row of
        gradients and loss per hosted vw (zeroed: backward accumulates), and the fixed-point buffer
        (fixed_dtype) of the SUM all-reduce (fixed-point sums, then the step's votes, then every vw's context).
        The rows are the first of the most this worker ever hosted: a resize that leaves it
        fewer vws allocates nothing (the first step after it would fault in hundreds of MB)."""
        rows, width = len(self.hosted), self._row_width
        if self._terms is None or self._terms.shape[0] < rows:
            self._terms = torch.zeros(rows, width, dtype=self._dtype, device=self._device)
            self._views_at, self._segments_at = {}, {}
        terms = self._terms[:rows]
        terms.zero_()
        return terms, self._total

    def _result_row(self, terms: torch.Tensor) -> torch.Tensor:
        """Where the step's exact sum goes back to floats (the gradient the optimiser reads, then
        the loss and metrics): the first row of the terms, free once the sum is accepted (a
        rejected prediction is scaled again from the terms before this), so that a strict worker
        holds two gradient-sized buffers of its own (the terms, the integers) rather than three. A
        worker that hosts no vw has no rows and gets a buffer of its own."""
        if len(terms):
            return terms[0]
        if self._result is None:
            self._result = torch.zeros(self._row_width, dtype=self._dtype, device=self._device)
        return self._result

    def warm_up(self, rows: int) -> None:
        """Runs one forward and backward pass on `rows` samples into the step's own buffers (the
        rows of the vws hosted now), in eval mode and without an optimiser step, then zeroes
        them: a joiner (or a prepared standby) pays for their first touch before the resize's
        pause rather than in it."""
        terms, _ = self._step_buffers()
        if len(terms):
            self._point_gradients_at(terms[0, : self._gradient_size])
            self._warm_pass(rows)
        terms.zero_()

    def _segment_max_abs(self, terms: torch.Tensor, shares: list[float] | None = None) -> torch.Tensor:
        """Each segment's (parameter's, the loss's, the metrics') largest magnitude over the
        hosted vws' rows as they are summed, as float64 for the MAX all-reduce. A row's gradient
        segments do not carry its share of the batch yet (`shares[row]`, 1 if None: the share
        is applied with the scale, in the same pass); its loss and metrics do. Rounding is
        monotonic, so fl(max |g| x share) is the very max of |fl(g x share)|: no pass over the
        shared terms is needed to know it."""
        if not len(terms):
            return torch.zeros(len(self._bounds), dtype=torch.float64, device=self._device)
        gradients = len(self._parameters)
        rows = []
        for index, row in enumerate(terms):
            magnitudes = self._row_max_abs(row)
            if shares is not None:
                magnitudes[:gradients].mul_(shares[index])  # in the terms' dtype, as the terms
            rows.append(magnitudes)
        largest = rows[0] if len(rows) == 1 else torch.stack(rows).amax(dim=0)  # NaN stays NaN
        return largest.to(torch.float64)

    def _row_max_abs(self, row: torch.Tensor) -> torch.Tensor:
        """Each segment's max |x| in one row, in the row's dtype (NaN stays NaN)."""
        segments = self._segments(row)
        if row.is_cuda:
            # Every segment's max |x| (its inf-norm: no arithmetic, so exact) in one multi-tensor
            # kernel, and no host round trip: on a GPU, a kernel per segment and a float() each
            # (one synchronisation per parameter) made the step launch-bound.
            return torch.stack(torch._foreach_norm(segments, math.inf))
        # On a CPU the multi-tensor inf-norm is a per-tensor loop of linalg_vector_norm, 20 times
        # slower than one vectorised min/max pass each (5.5 against 0.28 ms for 1.6M floats):
        # it was most of a strict step's overhead. max(-min, max) is exact too.
        lowest, highest = self._extremes
        for i, segment in enumerate(segments):
            if segment.numel():
                torch.aminmax(segment, out=(lowest[i], highest[i]))
            else:
                lowest[i] = highest[i] = 0
        return torch.maximum(lowest.neg(), highest)

    def _segments(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Views of each segment (parameter, then the loss and metrics) of one row, made once a
        row and kept as the gradients' views are (64 slices took 49 us of host time, three times a
        step); they keep the row alive, so an address is never another row's while kept."""
        key = (row.data_ptr(), row.dtype)
        segments = self._segments_at.get(key)
        if segments is None:
            segments = self._segments_at[key] = [row[begin:stop] for begin, stop in self._bounds]
        return segments

    def _scales(self, max_abs: torch.Tensor) -> list[float]:
        """Each segment's power-of-two scale (exact_sum.tensor_scales), capped below the
        gradients' dtype's overflow (a tensor whose largest entry is below about 2^-66 then
        keeps fewer bits); every worker computes the same from the same MAX."""
        return self._scales_of(self.to_host(max_abs))  # a step that takes the MAX reads it

    def _scales_of(self, max_abs: list[float]) -> list[float]:
        largest = 2.0 ** math.floor(math.log2(torch.finfo(self._dtype).max / 2))
        scales = tensor_scales(torch.tensor(max_abs, dtype=torch.float64), self.virtual_workers, self._int_bits)
        return scales.clamp_(max=largest).tolist()

    def _vote_on_device(self, max_abs: torch.Tensor, scales: list[float], votes: torch.Tensor) -> torch.Tensor:
        """_vote computed on the device from the magnitudes there (float64, as the host's
        floats: the same votes), with no read; returns whether some term here is over, on the
        device."""
        scaled = max_abs * self._on_device(scales, torch.float64)
        over = scaled > self._highest_scaled
        votes.copy_(torch.stack([over, scaled > self._lowest_scaled, max_abs > 0]))
        return over.any()

    def _on_device(self, values: list[float], dtype: torch.dtype) -> torch.Tensor:
        """`values` on the device, copied from pinned memory on a GPU (no sync)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self._device.type == "cuda")
        return host.to(self._device, non_blocking=True)

    def _vote(self, magnitudes: list[float], scales: list[float], votes: torch.Tensor) -> bool:
        """Writes this rank's votes on the predicted `scales` into `votes` (a row each: terms
        whose scaled magnitude is over the integers' range, terms whose scaled magnitude is
        within the precision floor, nonzero terms; a column per segment) and returns whether any
        term is over. `magnitudes` are this rank's (the max over its hosted vws: the vote is the
        same whichever vws a rank hosts, and so is the SUM of the votes)."""
        scaled = [magnitude * scale for magnitude, scale in zip(magnitudes, scales, strict=True)]
        over = [value > self._highest_scaled for value in scaled]
        within = [value > self._lowest_scaled for value in scaled]
        nonzero = [magnitude > 0 for magnitude in magnitudes]
        decided = torch.tensor([over, within, nonzero], dtype=votes.dtype, pin_memory=votes.is_cuda)
        votes.copy_(decided, non_blocking=votes.is_cuda)  # from pinned memory: no sync on a GPU
        return any(over)

    def _accepted(self, votes: list[int]) -> bool:
        """Whether the SUM of every rank's votes (the rows of _vote, flat) accepts the predicted
        scales: no term of any segment over the integers' range, and in every segment that is
        not all zeros some term within the precision floor (its largest entry keeps at least
        MIN_SPARE_BITS bits)."""
        segments = len(self._bounds)
        over, within, nonzero = (votes[row * segments : (row + 1) * segments] for row in range(_VOTES))
        return not any(over) and all(w > 0 or n == 0 for w, n in zip(within, nonzero, strict=True))

    def _to_fixed(
        self,
        terms: torch.Tensor,
        scales: list[float],
        shares: list[float],
        into: torch.Tensor,
        scaled_by: list[float] | None = None,
        unless: torch.Tensor | None = None,
    ) -> None:
        """Writes the sum over the hosted vws of each term in fixed point into `into`: the term
        times its row's share (gradients only: the loss and metrics carry it) and its segment's
        scale, in one multiplication, then truncated toward zero by the conversion to integers.
        `scaled_by`: the scales the terms already carry (a rejected prediction's), shares and
        all. A power-of-two scale commutes with the rounding of the share's product (but for
        subnormals, which are 0 in `into` either way), and each integer is a function of its vw's
        gradient, share and scale alone: the sum is the same on every placement. The terms are
        left multiplied, not truncated, so that a rejected prediction can scale them again."""
        if not len(terms):
            into.zero_()
            return
        gradients = len(self._parameters)
        for index, row in enumerate(terms):
            if scaled_by is not None:  # a rejected prediction's: scale by the ratio, a power of two
                factors = [new / old for new, old in zip(scales, scaled_by, strict=True)]
            else:
                share = shares[index]
                factors = [scale * share for scale in scales[:gradients]] + scales[gradients:]
            if unless is None:
                torch._foreach_mul_(self._segments(row), factors)  # one kernel
            else:  # each segment's factor, or 1 where `unless` (on the device) holds
                kept = torch.where(unless, 1.0, self._on_device(factors, self._dtype))
                row.mul_(kept.repeat_interleave(self._segment_sizes, output_size=row.numel()))
            if index == 0:
                into.copy_(row)  # float to int: truncated toward zero
            else:
                into.add_(row.to(self._fixed))
        if unless is not None:
            into.masked_fill_(unless, 0)

    def _point_gradients_at(self, flat: torch.Tensor) -> None:
        """Makes every parameter's gradient a view of its slice of `flat`, so that backward
        writes this vw's gradient there. The views of a row are made once and kept (a step
        points the gradients twice a hosted vw: making 62 views each time was 0.1 ms of host
        time); they keep the rows alive, so an address is never another row's while kept."""
        views = self._views_at.get(flat.data_ptr())
        if views is None:
            views, offset = [], 0
            for parameter in self._parameters:
                size = parameter.numel()
                views.append(flat[offset : offset + size].view_as(parameter))
                offset += size
            self._views_at[flat.data_ptr()] = views
        for parameter, view in zip(self._parameters, views, strict=True):
            if parameter.grad is not view:
                parameter.grad = view
