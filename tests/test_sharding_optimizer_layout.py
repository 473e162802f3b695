"""Whether an optimiser's update of an element depends on how its tensor is cut: strict mode
over shards needs each element of a shard to step exactly as it would in the whole tensor, and
as in any other cut (the world size changes with every resize). Adam, AdamW and SGD with
momentum, each with torch's for-each and per-tensor implementations, step the whole tensors and
the same tensors cut as fully_shard cuts them over 1 to 5 workers (shards of odd lengths, so
vectorised loops end in different places); every element comes out bit for bit the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from elastic.worker.reshard import shard_rows

SHAPES = [(37, 5), (101,), (16, 3, 3), (4099, 9)]
"""Odd row counts; the last is past the size torch splits over threads (32,768 elements)."""

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor], bool], torch.optim.Optimizer]] = {
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-3, foreach=foreach),
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=foreach),
    "sgd-momentum": lambda params, foreach: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach),
}


def _steps(
    tensors: list[torch.Tensor],
    gradients: list[list[torch.Tensor]],
    make: Callable[..., torch.optim.Optimizer],
    foreach: bool,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    optimizer = make(params, foreach)
    for step_gradients in gradients:
        for param, gradient in zip(params, step_gradients, strict=True):
            param.grad = gradient.clone()
        optimizer.step()
    return [p.detach() for p in params], [optimizer.state[p] for p in params]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per-tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_element_steps_the_same_whatever_the_cut(name: str, foreach: bool) -> None:
    generator = torch.Generator().manual_seed(4)
    whole = [torch.randn(shape, generator=generator) for shape in SHAPES]
    gradients = [
        [torch.randn(shape, generator=generator) * 10.0 ** (step - 2) for shape in SHAPES]
        for step in range(4)
    ]
    expected, expected_state = _steps(whole, gradients, OPTIMIZERS[name], foreach)
    for world in range(1, 6):
        for rank in range(world):
            cuts = [slice(*shard_rows(shape[0], world, rank)) for shape in SHAPES]
            got, state = _steps(
                [t[cut] for t, cut in zip(whole, cuts, strict=True)],
                [[g[cut] for g, cut in zip(step, cuts, strict=True)] for step in gradients],
                OPTIMIZERS[name],
                foreach,
            )
            for index, cut in enumerate(cuts):
                assert torch.equal(got[index], expected[index][cut]), (world, rank, index)
                for key, value in expected_state[index].items():
                    if value.dim() > 0:
                        assert torch.equal(state[index][key], value[cut]), (world, rank, index, key)
