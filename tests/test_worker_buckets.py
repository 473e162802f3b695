"""The gradient's all-reduce overlapped with backward (elastic.worker.trainer.GradientBuckets):
the bucket plan, and over real gloo groups the same sums as one all-reduce of the whole buffer
after backward, a parameter the batch does not use included."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.worker.trainer import GradientBuckets


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 40)
        self.unused = torch.nn.Parameter(torch.ones(30))  # no gradient ever reaches it
        self.second = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_buckets_are_contiguous_slices_from_the_last_parameter() -> None:
    parameters = [torch.zeros(n, requires_grad=True) for n in (100, 10, 300, 20, 5)]  # float32: 4 bytes each
    buckets = GradientBuckets(parameters, bucket_bytes=400)
    # From the last: 20 + 5 elements (100 bytes); 300 alone (1,200 bytes, more than a bucket); 10
    # alone (10 and 100 together would be 440 bytes); then 100.
    assert buckets.slices == [(410, 435), (110, 410), (100, 110), (0, 100)]
    covered = sorted(buckets.slices)
    assert covered[0][0] == 0 and covered[-1][1] == 435
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def _overlapped(rank: int, init: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(3)  # the same model on both ranks
        model = Net()
        parameters = list(model.parameters())
        size = sum(p.numel() for p in parameters)
        buffer = torch.zeros(size)
        offset = 0
        for parameter in parameters:
            parameter.grad = buffer[offset : offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
        buckets = GradientBuckets(parameters, bucket_bytes=4 * 150)  # several buckets
        assert len(buckets.slices) >= 3
        generator = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
        x = torch.randn(8, 6, generator=generator)
        # The reference: backward, then one all-reduce of the whole scaled buffer.
        model(x).square().mean().backward()
        expected = buffer.clone().mul_(0.5)
        dist.all_reduce(expected)
        buffer.zero_()
        buckets.arm(buffer, 0.5)
        model(x).square().mean().backward()
        for request in buckets.finish():
            request.wait()
        torch.save({"got": buffer.clone(), "expected": expected}, f"{out}/{rank}.pt")
        # A backward outside a step (a warm-up) sends nothing: the next collective still matches.
        model(x).sum().backward()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_overlapped_sums_equal_one_all_reduce_after_backward(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    # Spawned, not forked: these ranks compute, and a fork of a process whose OpenMP threads
    # ran (as the suite's have by now) hangs in its first parallel region.
    mp.start_processes(
        _overlapped, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(saved["got"], saved["expected"]), rank
    assert torch.equal(torch.load(tmp_path / "0.pt")["got"], torch.load(tmp_path / "1.pt")["got"])
