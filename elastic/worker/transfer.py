"""Moving the training state from the workers that hold it to the ones that join, through the
new process group's memory, never through disk.

The state is the model's state_dict (parameters and buffers) and the optimiser's state; the
step counter, the learning rates and every small value travel in a `StateOutline` that the
sources send with the group's first collective. Everything else, the bulk, goes point to point:

- Every tensor is seen as its bytes. The byte stream is cut into chunks of at most
  `chunk_bytes`: a large tensor becomes several slices, small tensors are packed together.
- Chunks are dealt to the sources so that each sends about the same number of bytes, and the
  sources send concurrently (asynchronous sends and receives, every receive posted at once).
- With `relay`, a source sends a chunk once, whatever the number of receivers: the chunk goes
  down a chain of the receivers, each forwarding it to the next as soon as it has it (while it
  receives the next chunks), as Elan's replication relays the state along the devices. The
  chain starts at a different receiver for each chunk, so every receiver forwards an equal
  share; the sources' links carry the state once. Without it, each source sends its chunks to
  every receiver. Which one a resize takes is the worker's setting (`auto`: relay only across
  nodes, elastic.worker.restore.relayed): on one host the chain was the slower, two joiners'
  whole transfer 2.2-2.4x one joiner's against 1.5-1.6x sent to each
  (bench/results/resize-routes-barrier-cpu-2core-amd-2026-11-26.txt).
- A receiver receives a slice straight into its own, already built tensor; only packed small
  tensors pass through a temporary buffer. Memory therefore does not double on either side.

Every rank of the group calls `move_state` with the same tensor list (same model, same optimiser
built the same way), so all cut the same chunks, and it ends on every rank once every receiver
holds the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 16 * 2**20
"""Chunks this big keep a few sends in flight per source without large temporary buffers."""
OUTLINE_MAX_ELEMENTS = 64
"""Optimiser tensors this small (a step count, say) travel in the outline, by value."""


@dataclass(frozen=True)
class TensorSlot:
    """Stands for a large optimiser tensor in a StateOutline: it comes point to point."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StateOutline:
    """What a joiner needs before the bulk arrives: the step, and the optimiser's state_dict
    with each large tensor replaced by a TensorSlot. Picklable, small."""

    step: int
    optimizer: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    """The consistency mode's small values (elastic.worker.trainer.Trainer.small_state)."""


def _is_bulk(value: Any, device: torch.device) -> bool:
    return isinstance(value, torch.Tensor) and value.device == device and value.numel() > OUTLINE_MAX_ELEMENTS


def outline(step: int, optimizer: torch.optim.Optimizer, device: torch.device) -> StateOutline:
    """Returns the outline of `optimizer`'s state after `step` completed steps."""
    state_dict = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        state[index] = {
            name: TensorSlot(tuple(value.shape), value.dtype)
            if _is_bulk(value, device)
            else (value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value)
            for name, value in entries.items()
        }
    return StateOutline(step=step, optimizer={"state": state, "param_groups": state_dict["param_groups"]})


def touched_like(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor | None]:
    """Memory for the optimiser state a joiner will receive, made and first touched while the
    job still trains: a zeroed tensor shaped like each of `optimizer`'s parameters (in the
    state_dict's order), as momentum and Adam's first moment are. On a CPU a receive into fresh
    memory pays a page fault per 4 kB inside the pause: 205 MB took 0.094 s into fresh pages and
    0.041 s into touched ones, each in a new process (bench/receive_pages.py --new-process). Not
    on a GPU, whose memory has no such first touch (and a standby's device memory stays free)."""
    if device.type != "cpu":
        return []
    # Contiguous whatever the parameter's layout (a channels-last weight's zeros_like is not),
    # as the torch.empty it stands in for: the transfer moves a tensor as its bytes in order.
    return [
        torch.zeros(p.shape, dtype=p.dtype, device=p.device) for group in optimizer.param_groups for p in group["params"]
    ]


def apply_outline(
    optimizer: torch.optim.Optimizer,
    state: StateOutline,
    device: torch.device,
    touched: list[torch.Tensor | None] | None = None,
) -> None:
    """Gives `optimizer` the outline's learning rates, small values, and empty tensors of the
    right shape where the bulk will arrive (see state_tensors). A parameter's first large tensor
    of its parameter's shape and dtype takes that parameter's entry of `touched` (touched_like),
    which it uses up; the others are plain torch.empty, on 4 kB pages first touched by the
    receive. (Fresh transparent huge pages received faster in a benchmark that reused one
    process, but a joiner is a new process each time, and in the platform its first huge pages
    made one joiner's transfer 2-3x slower:
    bench/results/land-receive-pages-ab-cpu-2core-amd-2026-11-26.txt.)"""
    spare = touched if touched is not None else []

    def memory_for(index: int, slot: TensorSlot) -> torch.Tensor:
        ready = spare[index] if index < len(spare) else None
        if ready is not None and tuple(ready.shape) == slot.shape and ready.dtype == slot.dtype:
            spare[index] = None
            return ready
        return torch.empty(slot.shape, dtype=slot.dtype, device=device)

    entries = {
        index: {
            name: memory_for(index, value) if isinstance(value, TensorSlot) else value
            for name, value in values.items()
        }
        for index, values in state.optimizer["state"].items()
    }
    optimizer.load_state_dict({"state": entries, "param_groups": state.optimizer["param_groups"]})


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> list[torch.Tensor]:
    """Returns the tensors that make up the bulk of the training state, in an order that every
    worker of the job computes alike: the model's state_dict, then each parameter's large
    optimiser tensors by name. Writing into them writes into the model and the optimiser."""
    tensors = list(model.state_dict().values())
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            entries = optimizer.state.get(parameter, {})
            tensors.extend(entries[name] for name in sorted(entries) if _is_bulk(entries[name], device))
    return tensors


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Bytes [start, stop) of tensor number `tensor`."""

    tensor: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class Chunk:
    """What one message carries: a slice of one tensor, or several small tensors packed."""

    pieces: list[Piece] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.pieces)


def plan_chunks(sizes: list[int], chunk_bytes: int) -> list[Chunk]:
    """Cuts tensors of `sizes` bytes, in order, into chunks of at most `chunk_bytes`: a tensor
    larger than that is sliced, consecutive smaller ones are packed. Empty tensors are left out.
    Raises ValueError if chunk_bytes is not positive."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be at least 1")
    chunks: list[Chunk] = []
    packing = Chunk()
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= chunk_bytes:
            for start in range(0, size, chunk_bytes):
                chunks.append(Chunk([Piece(index, start, min(size, start + chunk_bytes))]))
            continue
        if packing.size + size > chunk_bytes:
            chunks.append(packing)
            packing = Chunk()
        packing.pieces.append(Piece(index, 0, size))
    if packing.pieces:
        chunks.append(packing)
    return chunks


def assign_sources(chunks: list[Chunk], sources: list[int]) -> list[int]:
    """Returns, for each chunk, the rank that sends it: each goes to the source with the fewest
    bytes so far (the lowest rank on a tie), so the sources share the bytes evenly. Raises
    ValueError if there is no source."""
    if not sources:
        raise ValueError("no source holds the training state")
    load = dict.fromkeys(sorted(sources), 0)
    owners = []
    for chunk in chunks:
        source = min(load, key=lambda rank: (load[rank], rank))
        load[source] += chunk.size
        owners.append(source)
    return owners


def relay_routes(chunk_count: int, receivers: list[int]) -> list[list[int]]:
    """Returns, for each chunk, the receivers in the order it passes through them: the chain of
    chunk k starts at receiver k mod R (in `receivers`' order) and goes on round the list, so the
    first hops, and so the forwarding, are spread evenly."""
    count = len(receivers)
    return [receivers[k % count :] + receivers[: k % count] for k in range(chunk_count)] if count else []


def chunk_chains(chunk_count: int, receivers: list[int], relay: bool) -> list[list[list[int]]]:
    """Returns, for each chunk, the chains it travels: its source sends it to the head of each
    chain, and each receiver passes it to the next in its chain. Relayed, one chain through
    every receiver (relay_routes); direct, a chain of one for each receiver."""
    if relay:
        return [[route] for route in relay_routes(chunk_count, receivers)]
    return [[[receiver] for receiver in receivers] for _ in range(chunk_count)] if receivers else []


# --- moving ----------------------------------------------------------------------------------


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """Returns a flat uint8 view of `tensor`'s memory. Raises ValueError if it is not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError(f"a state tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class TransferResult:
    bytes_moved: int
    """Bytes that crossed the group: the state once per receiver."""
    state_bytes: int


def move_state(
    tensors: list[torch.Tensor],
    sources: list[int],
    receivers: list[int],
    rank: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    relay: bool = True,
) -> TransferResult:
    """Copies `tensors` from the ranks in `sources` (which hold them) into the same tensors on
    the ranks in `receivers`, over the default process group, each chunk relayed down a chain of
    the receivers or (`relay` False) sent to each of them. Every rank of the group calls it, with
    the same list layout and the same `relay`, and it returns on every rank once every receiver
    holds the state: a source's own sends are done while the chains still carry its last chunks,
    so without that wait a source's transfer phase left their tail to the first step. Raises
    what torch.distributed raises if a peer fails."""
    views = [_bytes_of(tensor) for tensor in tensors]
    chunks = plan_chunks([view.numel() for view in views], chunk_bytes)
    state_bytes = sum(chunk.size for chunk in chunks)
    result = TransferResult(bytes_moved=state_bytes * len(receivers), state_bytes=state_bytes)
    if not receivers or not chunks:
        return result
    if rank in sources or rank in receivers:
        _exchange(views, chunks, sources, receivers, rank, relay)
    dist.barrier()
    return result


def _exchange(
    views: list[torch.Tensor], chunks: list[Chunk], sources: list[int], receivers: list[int], rank: int, relay: bool
) -> None:
    """This rank's part of move_state: its sends, receives and forwards of `chunks` of the
    byte `views`, done when its own are."""
    owners = assign_sources(chunks, sources)
    chains = chunk_chains(len(chunks), sorted(receivers), relay)
    sends: list[tuple[Any, torch.Tensor]] = []  # each send's buffer lives until it is done
    receives: list[tuple[Any, torch.Tensor, int | None, int]] = []
    unpack: list[tuple[torch.Tensor, Chunk]] = []
    # gloo sends no CUDA tensor point to point (workers sharing a GPU): stage through the host.
    staged = views[0].device.type == "cuda" and dist.get_backend() == "gloo"
    device = torch.device("cpu") if staged else views[0].device
    for tag, (chunk, owner, routes) in enumerate(zip(chunks, owners, chains, strict=True)):
        if rank == owner:
            if len(chunk.pieces) == 1:
                piece = chunk.pieces[0]
                buffer = views[piece.tensor][piece.start : piece.stop]
            else:
                buffer = torch.cat([views[p.tensor][p.start : p.stop] for p in chunk.pieces])
            buffer = buffer.to(device)
            for route in routes:
                sends.append((dist.isend(buffer, route[0], tag=tag), buffer))
            continue
        mine = [route for route in routes if rank in route]
        if mine:
            route = mine[0]
            hop = route.index(rank)
            if len(chunk.pieces) == 1 and not staged:
                piece = chunk.pieces[0]
                buffer = views[piece.tensor][piece.start : piece.stop]
            else:
                buffer = torch.empty(chunk.size, dtype=torch.uint8, device=device)
                unpack.append((buffer, chunk))
            forward_to = route[hop + 1] if hop + 1 < len(route) else None
            receives.append((dist.irecv(buffer, owner if hop == 0 else route[hop - 1], tag=tag), buffer, forward_to, tag))
    # In chunk order: a chunk is passed on as soon as it is here, while the later ones arrive.
    for request, buffer, forward_to, tag in receives:
        request.wait()
        if forward_to is not None:
            sends.append((dist.isend(buffer, forward_to, tag=tag), buffer))
    for request, _ in sends:
        request.wait()
    for buffer, chunk in unpack:
        offset = 0
        for piece in chunk.pieces:
            views[piece.tensor][piece.start : piece.stop].copy_(buffer[offset : offset + piece.size])
            offset += piece.size


def gigabytes_per_second(byte_count: int, seconds: float) -> float:
    """Returns byte_count / seconds in GB/s (10^9), or NaN for a zero duration."""
    return byte_count / seconds / 1e9 if seconds > 0 else math.nan
