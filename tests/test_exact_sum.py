"""The exact gradient sum's arithmetic: at the scales of elastic.consistency.exact_sum, fixed-point
terms (each multiplied by its power-of-two scale and truncated, as strict mode's step does) sum to
the same bits whatever the grouping of virtual workers, where a plain float sum does not, and
close to the float64 sum. The trainer itself, over real gloo groups of 1 to 4 processes, is in
tests/test_worker_strict_consistency.py."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.consistency.exact_sum import tensor_scales

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
    count = len(terms[0])
    max_abs = torch.stack([torch.stack([t[i].abs().max() for t in terms]).max() for i in range(count)]).double()
    scales = tensor_scales(max_abs, V)
    totals = [torch.zeros(terms[0][i].shape, dtype=torch.int64) for i in range(count)]
    for group in groups:
        partial = [torch.zeros_like(t) for t in totals]
        for vw in group:
            for i in range(count):
                partial[i] += (terms[vw][i] * scales[i].float()).to(torch.int64)  # truncated
        for i in range(count):
            totals[i] += partial[i]
    return [(t.to(torch.float64) / scales[i]).float() for i, t in enumerate(totals)]


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
