"""Shared by the tests that run real workers: their environment, and the ledger of which samples
each step trained on (BUNGEE_RECORD_SAMPLES), checked against the job's sample stream."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.consistency.placement import even_shares, hosted
from elastic.worker.data import SampleStream, share_bounds

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
TEST_DEVICE = os.environ.get("BUNGEE_TEST_DEVICE", "cpu")
"""Where the bitwise tests train: "cpu" (the suite), or "cuda" on a GPU machine, where every
worker shares GPU 0 (gloo; NCCL refuses two ranks on one GPU)."""
DIGITS_SAMPLES = 1437


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of the workers a test starts: one thread each, short timeouts."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUNGEE_PG_TIMEOUT_S": "20",
        "BUNGEE_PROGRESS_EVERY_S": "0.1",
        **({"BUNGEE_SHARED_GPU": "1"} if TEST_DEVICE == "cuda" else {}),
        **extra,
    }


@dataclass
class StepRecord:
    generation: int
    world_size: int
    shares: dict[int, list[int]] = field(default_factory=dict)
    """rank -> sample indices."""


@dataclass
class Ledger:
    """What the workers recorded, step by step (0-based)."""

    steps: dict[int, StepRecord]

    @staticmethod
    def read_all(path: Path, job_id: int | None = None) -> dict[int, list[StepRecord]]:
        """Reads the record file: per step, what each generation that trained it recorded, in
        order (a step is trained twice only when the job went back to its checkpoint). Raises
        AssertionError if a rank of a generation recorded a step twice."""
        steps: dict[int, list[StepRecord]] = {}
        for line in path.read_text().splitlines():
            entry: dict[str, Any] = json.loads(line)
            if job_id is not None and entry["job_id"] != job_id:
                continue
            records = steps.setdefault(entry["step"], [])
            if not records or records[-1].generation != entry["generation"]:
                records.append(StepRecord(entry["generation"], entry["world_size"]))
            record = records[-1]
            assert entry["rank"] not in record.shares, f"step {entry['step']} rank {entry['rank']} twice"
            record.shares[entry["rank"]] = entry["indices"]
        return steps

    @classmethod
    def read(cls, path: Path, job_id: int | None = None) -> Ledger:
        """Reads the record file of a job that never went back to its checkpoint. Raises
        AssertionError if a step was trained by two generations."""
        steps = cls.read_all(path, job_id)
        for step, records in steps.items():
            assert len(records) == 1, f"step {step} trained by several generations: {records}"
        return cls({step: records[0] for step, records in steps.items()})

    def generations(self) -> list[int]:
        """The generations in the order they trained."""
        order: list[int] = []
        for step in sorted(self.steps):
            if not order or order[-1] != self.steps[step].generation:
                order.append(self.steps[step].generation)
        return order

    def check(
        self,
        stream: SampleStream,
        batch_size: int,
        first: int = 0,
        partial: int = 0,
        virtual_workers: int | None = None,
    ) -> int:
        """Checks that steps first.. are contiguous and each trained on exactly its global batch,
        each rank its share (a strict job's, of `virtual_workers`, is the slices of the virtual
        workers it hosts, even shares), so that no sample is skipped or seen twice; up to `partial` steps
        (the step in flight when a worker died: it completed on some ranks, which recorded it,
        and not on the dead one) may lack shares, never have wrong ones. Returns the number of
        steps checked. Raises AssertionError."""
        steps = sorted(step for step in self.steps if step >= first)
        assert steps == list(range(first, first + len(steps))), f"steps missing: {steps}"
        incomplete = []
        for step in steps:
            record = self.steps[step]
            batch = stream.global_batch(step, batch_size).tolist()
            for rank, indices in record.shares.items():
                start, stop = rank_bounds(batch_size, record.world_size, rank, virtual_workers)
                assert indices == batch[start:stop], f"step {step} rank {rank} trained on the wrong samples"
            if sorted(record.shares) != list(range(record.world_size)):
                incomplete.append(step)
        assert len(incomplete) <= partial, f"steps with shares missing: {incomplete}"
        return len(steps)


def rank_bounds(batch_size: int, world_size: int, rank: int, virtual_workers: int | None) -> tuple[int, int]:
    """The [start, stop) slice of the global batch that `rank` trains on: its share of the batch,
    or in strict mode (`virtual_workers` given) the slices of the virtual workers it hosts."""
    if virtual_workers is None:
        return share_bounds(batch_size, world_size, rank)
    mine = hosted(even_shares(virtual_workers, world_size), rank)
    if not mine:
        return 0, 0
    return share_bounds(batch_size, virtual_workers, mine[0])[0], share_bounds(
        batch_size, virtual_workers, mine[-1]
    )[1]
