"""The exact gradient sum: the same bits whatever the grouping of virtual workers, where a plain
float sum is not; checked in-process and over a real gloo group of 1, 2 and 3 processes."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.consistency.exact_sum import ExactGradientSum

V = 6


def gradients(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(17, 5), (5,), (3, 3, 2)]
    return [
        [torch.randn(shape, generator=generator) * 10 ** float(torch.randint(-4, 4, (1,), generator=generator)) for shape in shapes]
        for _ in range(V)
    ]


def local_sum(groups: list[list[int]], terms: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Simulates placement `groups` (virtual workers per physical worker) without processes:
    each group adds its terms, then the groups' int64 totals are added as the all-reduce would."""
    from elastic.consistency.exact_sum import from_fixed, tensor_scales, to_fixed

    count = len(terms[0])
    max_abs = torch.stack([torch.stack([t[i].abs().max() for t in terms]).max() for i in range(count)]).double()
    scales = tensor_scales(max_abs, V)
    totals = [torch.zeros(terms[0][i].shape, dtype=torch.int64) for i in range(count)]
    for group in groups:
        partial = [torch.zeros_like(t) for t in totals]
        for vw in group:
            for i in range(count):
                partial[i] += to_fixed(terms[vw][i], scales[i])
        for i in range(count):
            totals[i] += partial[i]
    return [from_fixed(t, scales[i], torch.float32) for i, t in enumerate(totals)]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, V - 1), unique=True, max_size=V - 1),
       order=st.permutations(list(range(V))))
def test_any_grouping_gives_the_same_bits(seed: int, cuts: list[int], order: list[int]) -> None:
    terms = gradients(seed)
    bounds = [0, *sorted(cuts), V]
    groups = [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    reference = local_sum([list(range(V))], terms)
    for got, want in zip(local_sum(groups, terms), reference, strict=True):
        assert torch.equal(got, want)


def test_it_is_close_to_the_float64_sum() -> None:
    terms = gradients(7)
    exact = local_sum([list(range(V))], terms)
    for i, got in enumerate(exact):
        want = sum(t[i].double() for t in terms)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9 * want.abs().max().item())


def test_plain_float_sums_do_depend_on_grouping() -> None:
    """Why this module exists: the same numbers, grouped 6 and 3+3, round differently."""
    terms = gradients(3)
    differs = False
    for i in range(len(terms[0])):
        flat = sum(t[i] for t in terms)
        grouped = sum(t[i] for t in terms[:3]) + sum(t[i] for t in terms[3:])
        differs |= not torch.equal(flat, grouped)
    assert differs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, placement: list[list[int]], out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    terms = gradients(11)
    summer = ExactGradientSum(V)
    for vw in placement[rank]:
        summer.add(terms[vw])
    result = summer.result()
    if rank == 0:
        out[world] = [t.clone() for t in result]
    dist.destroy_process_group()


@pytest.mark.slow
def test_over_real_gloo_groups() -> None:
    placements = {1: [list(range(V))], 2: [[0, 1, 2, 3], [4, 5]], 3: [[5, 0], [3, 1], [2, 4]]}
    results = mp.Manager().dict()
    for world, placement in placements.items():
        mp.spawn(_worker, args=(world, _free_port(), placement, results), nprocs=world, join=True)
    for world in (2, 3):
        for got, want in zip(results[world], results[1], strict=True):
            assert torch.equal(got, want), world
