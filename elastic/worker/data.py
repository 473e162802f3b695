"""Which samples each rank trains on at each step, computed from the step alone.

The sample stream is epoch 0's permutation of the training set, then epoch 1's, and so on; each
permutation comes from a generator seeded by (job seed, epoch). Step s trains on the stream's
positions [s * batch_size, (s + 1) * batch_size), so a batch that crosses an epoch boundary takes
the tail of one permutation and the head of the next: within an epoch no sample is skipped or
repeated. Rank r of W takes a contiguous share of the global batch. Because none of this depends
on anything but the step, the job's seed and the world size, a run that stops and resumes with
another world size trains on exactly the samples of a run that never stopped.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """Return a seed for torch's generators that depends on every one of `parts`.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so parts are hashed
    rather than packed side by side: a job seed in the high bits would be dropped.
    """
    text = "/".join(str(part) for part in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def seed_torch(seed: int, device: torch.device) -> None:
    """Seeds torch's generators for a step on `device`: the CPU's, and on a GPU every device's
    (torch.manual_seed). On a CPU worker only the CPU's: torch.manual_seed also queues the seeding
    of CUDA devices that are never initialised, taking a stack trace each time: 64 us a call in
    a shallow stack, 150-234 us at the 20-40 frames of a worker's, against 1 us, every step (for
    every virtual worker in strict mode). The CPU generator's state is the same either way, so
    are the steps' draws."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """Return epoch `epoch`'s order of the sample indices 0..num_samples-1 (int64, on CPU)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def share_bounds(count: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return the [start, stop) slice of a batch of `count` samples that `rank` trains on.

    Shares are contiguous and in rank order; they differ by at most one sample, the first
    `count % world_size` ranks taking the extra one. A rank beyond `count` gets an empty share.
    Raises ValueError if rank is not in 0..world_size-1.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in 0..{world_size - 1}")
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class SampleStream:
    """The endless stream of sample indices of one job, epoch after epoch."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples ({num_samples}) must be at least 1")
        self.num_samples = num_samples
        self.seed = seed
        self._permutations: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        permutation = self._permutations.get(epoch)
        if permutation is None:
            # Steps move forward, so only the epoch in progress and the next one are kept.
            self._permutations = {
                kept: value for kept, value in self._permutations.items() if kept == epoch - 1
            }
            permutation = epoch_permutation(self.seed, epoch, self.num_samples)
            self._permutations[epoch] = permutation
        return permutation

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """Return the sample indices at stream positions [start, stop), crossing epochs as
        needed. Raises ValueError if the range is negative."""
        if not 0 <= start <= stop:
            raise ValueError(f"stream range [{start}, {stop}) is not a range of positions")
        pieces = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.num_samples)
            take = min(stop - position, self.num_samples - offset)
            pieces.append(self._permutation(epoch)[offset : offset + take])
            position += take
        if not pieces:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(pieces)

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """Return the indices of the global batch of step `step` (0 for the job's first)."""
        return self.positions(step * batch_size, (step + 1) * batch_size)

    def local_batch(self, step: int, batch_size: int, world_size: int, rank: int) -> torch.Tensor:
        """Return the indices that `rank` of `world_size` trains on at step `step`."""
        start, stop = share_bounds(batch_size, world_size, rank)
        first = step * batch_size
        return self.positions(first + start, first + stop)
