"""The state transfer's plan, without processes: tensors cut into chunks (large ones sliced, small
ones packed, every byte once, in order), chunks dealt evenly to the sources, and the optimiser's
outline carrying the small values while large tensors wait for the bulk; the chains that relay
each chunk through the receivers. Then the transfer itself between real processes over gloo (and
in the tests with real workers: test_worker_resize_in_place, test_worker_failure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic.worker.transfer import (
    TensorSlot,
    apply_outline,
    assign_sources,
    chunk_chains,
    move_state,
    outline,
    plan_chunks,
    relay_routes,
    state_tensors,
    touched_like,
)


def test_large_tensors_are_sliced_small_ones_packed_every_byte_once() -> None:
    sizes = [10, 30, 0, 100, 5, 5, 41]
    chunks = plan_chunks(sizes, chunk_bytes=40)
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        assert 0 < chunk.size <= 40
        for piece in chunk.pieces:
            covered.setdefault(piece.tensor, []).append((piece.start, piece.stop))
    for index, size in enumerate(sizes):
        spans = sorted(covered.get(index, []))
        assert sum(stop - start for start, stop in spans) == size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    # Tensors of at least a chunk travel alone, in slices; smaller ones share chunks.
    alone = {c.pieces[0].tensor for c in chunks if len(c.pieces) == 1}
    packed = {p.tensor for c in chunks if len(c.pieces) > 1 for p in c.pieces}
    assert {3, 6} <= alone and len([c for c in chunks if c.pieces[0].tensor == 3]) == 3
    assert packed <= {0, 1, 4, 5} and packed
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(sizes, 0)


def test_sources_share_the_bytes_evenly() -> None:
    chunks = plan_chunks([64] * 9, chunk_bytes=16)
    owners = assign_sources(chunks, [3, 1, 2])
    load = {rank: sum(c.size for c, o in zip(chunks, owners, strict=True) if o == rank) for rank in (1, 2, 3)}
    assert max(load.values()) - min(load.values()) <= 16
    with pytest.raises(ValueError, match="no source"):
        assign_sources(chunks, [])


def test_the_outline_gives_a_fresh_optimiser_the_same_layout() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2), torch.nn.Linear(2, 300_000))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    device = torch.device("cpu")
    sent = outline(7, optimizer, device)
    kinds = [type(entries["momentum_buffer"]) for _, entries in sorted(sent.optimizer["state"].items())]
    # Only the 16x16 weight and the last layer are large enough to travel point to point; the
    # rest rides along.
    assert kinds == [TensorSlot, torch.Tensor, torch.Tensor, torch.Tensor, TensorSlot, TensorSlot]
    assert sent.step == 7 and sent.optimizer["param_groups"][0]["lr"] == 0.1

    twin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2), torch.nn.Linear(2, 300_000))
    fresh = torch.optim.SGD(twin.parameters(), lr=0.5, momentum=0.9)
    apply_outline(fresh, sent, device)
    assert fresh.param_groups[0]["lr"] == 0.1
    mine, theirs = state_tensors(model, optimizer, device), state_tensors(twin, fresh, device)
    assert [t.shape for t in mine] == [t.shape for t in theirs]
    assert [t.dtype for t in mine] == [t.dtype for t in theirs]
    # Writing into the listed tensors writes into the model and the optimiser.
    for source, target in zip(mine, theirs, strict=True):
        target.copy_(source)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        if optimizer.state[a]["momentum_buffer"].numel() > 64:
            assert torch.equal(optimizer.state[a]["momentum_buffer"], fresh.state[b]["momentum_buffer"])


def test_the_state_arrives_in_memory_touched_ahead_where_it_fits() -> None:
    """A joiner's build makes a zeroed tensor like each parameter (touched_like); the outline
    gives each parameter's first large tensor of its shape and dtype that memory, the optimiser
    holds it (no copy), and what does not fit (Adam's second moment) gets memory of its own. Each touched tensor serves once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 100), torch.nn.Linear(100, 300))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    device = torch.device("cpu")
    sent = outline(3, optimizer, device)

    twin = torch.nn.Sequential(torch.nn.Linear(16, 100), torch.nn.Linear(100, 300))
    fresh = torch.optim.Adam(twin.parameters(), lr=0.5)
    touched = touched_like(fresh, device)
    assert [t.shape for t in touched if t is not None] == [p.shape for p in twin.parameters()]
    assert all(t is not None and not t.any() for t in touched), "zeroed: every page touched"
    pointers = [t.data_ptr() for t in touched if t is not None]
    apply_outline(fresh, sent, device, touched)
    assert touched == [None] * 4, "used up"
    for parameter, pointer in zip(twin.parameters(), pointers, strict=True):
        state = fresh.state[parameter]
        assert state["exp_avg"].data_ptr() == pointer, "the first moment lies in the touched memory"
        assert state["exp_avg_sq"].data_ptr() != pointer
    mine, theirs = state_tensors(model, optimizer, device), state_tensors(twin, fresh, device)
    for source, target in zip(mine, theirs, strict=True):
        target.copy_(source)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[a][name], fresh.state[b][name])
    assert touched_like(fresh, torch.device("meta")) == [], "only a CPU's memory is touched ahead"
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    (made,) = touched_like(torch.optim.SGD([conv.weight], lr=0.1), device)
    assert made is not None and made.is_contiguous(), "the transfer moves contiguous tensors only"


def test_each_chunk_reaches_every_receiver_once_down_a_rotating_chain() -> None:
    routes = relay_routes(6, [3, 5, 7])
    assert routes[:3] == [[3, 5, 7], [5, 7, 3], [7, 3, 5]]
    assert all(sorted(route) == [3, 5, 7] for route in routes)
    # Every receiver is first (fed by a source) for a third of the chunks, and forwards as many.
    assert [sum(route[0] == r for route in routes) for r in (3, 5, 7)] == [2, 2, 2]
    assert [sum(r in route[:-1] for route in routes) for r in (3, 5, 7)] == [4, 4, 4]
    assert relay_routes(3, []) == []


def test_direct_each_chunk_goes_straight_to_every_receiver() -> None:
    assert chunk_chains(2, [3, 5], relay=False) == [[[3], [5]], [[3], [5]]]
    assert chunk_chains(2, [3, 5], relay=True) == [[[3, 5]], [[5, 3]]]
    assert chunk_chains(2, [], relay=False) == [] == chunk_chains(2, [], relay=True)


def _move(rank: int, world: int, init: str, sources: list[int], receivers: list[int], out: str, relay: bool) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # One thread, as a worker has: this process is forked from pytest's, whose OpenMP threads
    # (from an earlier test's large tensor op) do not exist here, and a parallel op would wait
    # for them forever.
    torch.set_num_threads(1)
    # A receive that never comes fails the test in 30 s, not gloo's 30 minutes.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        generator = torch.Generator().manual_seed(7)
        expected = [
            torch.randn(1000, generator=generator),  # packed with the next ones
            torch.randn(3, 5, generator=generator),
            torch.arange(7, dtype=torch.int64),
            torch.randn(10, generator=generator).to(torch.float16),
            torch.randn(600_000, generator=generator),  # sliced
        ]
        tensors = [
            t.clone() if rank in sources else torch.empty_like(t) for t in expected
        ]
        moved = move_state(tensors, sources, receivers, rank, chunk_bytes=256 * 1024, relay=relay)
        assert moved.state_bytes == sum(t.numel() * t.element_size() for t in expected)
        if rank in receivers:
            torch.save(tensors, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("relay", [True, False], ids=["relayed", "direct"])
@pytest.mark.parametrize(("sources", "receivers"), [([0, 1], [2, 3, 4]), ([0], [1, 2])])
def test_the_state_arrives_whole_at_every_receiver(
    tmp_path: Path, sources: list[int], receivers: list[int], relay: bool
) -> None:
    """Real processes over gloo (forked: torch is imported already): three receivers from two
    sources, and one source feeding two; down a chain, and straight to each."""
    import torch.multiprocessing as mp

    world = len(sources) + len(receivers)
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(
        _move, args=(world, init, sources, receivers, str(tmp_path), relay), nprocs=world, start_method="fork"
    )
    generator = torch.Generator().manual_seed(7)
    expected = [
        torch.randn(1000, generator=generator),
        torch.randn(3, 5, generator=generator),
        torch.arange(7, dtype=torch.int64),
        torch.randn(10, generator=generator).to(torch.float16),
        torch.randn(600_000, generator=generator),
    ]
    for rank in receivers:
        got = torch.load(tmp_path / f"{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), rank


LATE_S = 1.0
"""How late the chain's last receiver comes to the transfer in the test below."""


def _move_to_a_late_receiver(rank: int, init: str, out: str) -> None:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=timedelta(seconds=30))
    try:
        tensors = [torch.arange(100, dtype=torch.float32) if rank == 0 else torch.zeros(100)]
        if rank == 2:
            time.sleep(LATE_S)
        began = time.time()
        move_state(tensors, [0], [1, 2], rank, relay=True)  # one chunk: 0 -> 1 -> 2
        Path(f"{out}/{rank}.json").write_text(f"[{began}, {time.time()}, {float(tensors[0].sum())}]")
    finally:
        dist.destroy_process_group()


def test_the_transfer_ends_on_every_rank_once_the_last_receiver_holds_the_state(tmp_path: Path) -> None:
    """The source's sends are done once the first receiver has the chunk; it is the first
    receiver that forwards it to the second, which comes late. The transfer (the phase rank 0
    reports) ends on the source only after the second one took part."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(
        _move_to_a_late_receiver, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=3, start_method="fork"
    )
    times = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)}
    assert times[1][2] == times[2][2] == float(torch.arange(100).sum()), "both receivers hold the state"
    source_done, late_began = times[0][1], times[2][0]
    assert source_done >= late_began, (
        f"the source's transfer ended {late_began - source_done:.3f} s before the last receiver came to it"
    )
