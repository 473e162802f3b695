"""Where a strict job's virtual workers run: how many each physical worker hosts, and which.

Rank r hosts a contiguous run of virtual workers, after those of ranks 0..r-1. Shares are either
even (the default) or proportional to each worker's measured throughput, so that a faster device
hosts more virtual workers and the step's slowest worker finishes sooner. Either way the result
of training does not change: it depends on the set of virtual workers, never on their placement
(elastic.consistency.exact_sum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def even_shares(virtual_workers: int, world_size: int) -> list[int]:
    """Virtual workers per rank, differing by at most one, the first ranks taking the extra.
    Raises ValueError if world_size is not positive."""
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be at least 1")
    base, extra = divmod(virtual_workers, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def proportional_shares(virtual_workers: int, throughputs: Sequence[float]) -> list[int]:
    """Virtual workers per rank in proportion to `throughputs` (samples/s, or any rate), at
    least one each, by largest remainder: each rank first gets the whole part of its quota
    (one at least), then the rest go to the largest fractional parts, ties to the lower rank.
    Raises ValueError if there are fewer virtual workers than ranks or a rate is not positive."""
    ranks = len(throughputs)
    if ranks < 1:
        raise ValueError("no ranks to share virtual workers among")
    if virtual_workers < ranks:
        raise ValueError(f"{virtual_workers} virtual workers cannot give each of {ranks} ranks one")
    if not all(math.isfinite(rate) and rate > 0 for rate in throughputs):
        raise ValueError(f"throughputs must be positive, not {list(throughputs)}")
    total = sum(throughputs)
    quotas = [virtual_workers * rate / total for rate in throughputs]
    shares = [max(1, math.floor(quota)) for quota in quotas]
    while sum(shares) > virtual_workers:  # the ones raised to 1 took from the others
        spare = [r for r in range(ranks) if shares[r] > 1]
        largest = max(spare, key=lambda r: (shares[r] - quotas[r], -r))
        shares[largest] -= 1
    order = sorted(range(ranks), key=lambda r: (-(quotas[r] - shares[r]), r))
    for rank in order[: virtual_workers - sum(shares)]:
        shares[rank] += 1
    return shares


def hosted(shares: Sequence[int], rank: int) -> range:
    """The virtual workers that `rank` hosts under `shares`. Raises ValueError for a rank out of
    range."""
    if not 0 <= rank < len(shares):
        raise ValueError(f"rank ({rank}) must be in 0..{len(shares) - 1}")
    first = sum(shares[:rank])
    return range(first, first + shares[rank])


def check_shares(shares: Sequence[int], virtual_workers: int, world_size: int) -> None:
    """Raises ValueError unless `shares` gives each of `world_size` ranks a non-negative count
    and all `virtual_workers` are placed."""
    if len(shares) != world_size or any(share < 0 for share in shares) or sum(shares) != virtual_workers:
        raise ValueError(
            f"shares {list(shares)} do not place {virtual_workers} virtual workers on {world_size} ranks"
        )
