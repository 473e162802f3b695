"""Across an in-place scale-in to another world size, every step trains on exactly its global
batch and every sample of the epoch is seen exactly once. The batch of 5 divides evenly on
neither world size. The job is strict (the default) with 3 virtual workers of 2, 2 and 1 samples:
on 3 workers one each, on 2 workers shares of 4 and 1. (Shares of a world larger than the batch
are covered in test_worker_trainer.)"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from elastic.worker import COMPLETED_EXIT_CODE, LEFT_EXIT_CODE
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from tests.worker_support import REDIS_URL, worker_env

pytestmark = pytest.mark.slow

SAMPLES = 1437
BATCH = 5
SEED = 11
SPEC = {
    "name": "order",
    "workload": "digits-mlp",
    "epochs": 2,
    "seed": SEED,
    "max_workers": 3,  # strict mode, 3 virtual workers: 2 + 2 + 1 samples, then 4 + 1 on 2 workers
    "hyperparameters": {"batch_size": BATCH},
}
STEPS = -(-2 * SAMPLES // BATCH)  # the last batch ends with samples of epoch 2
FIRST_WORLD, SECOND_WORLD = 3, 2


def test_every_sample_of_the_epoch_once_across_a_resize(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record))
    with LocalJob(SPEC, tmp_path / "run", REDIS_URL, env=env, heal=False) as job:
        job.start(list(range(FIRST_WORLD)))
        job.wait_for(lambda _, event: event.kind == "progress")
        job.resize(list(range(SECOND_WORLD)))
        outputs = job.wait()
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE] * SECOND_WORLD + [LEFT_EXIT_CODE], [
        o.stderr for o in outputs
    ]

    shares: dict[int, dict[int, list[int]]] = defaultdict(dict)
    generations: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        assert entry["rank"] not in shares[entry["step"]], entry
        shares[entry["step"]][entry["rank"]] = entry["indices"]
        generations[entry["step"]].add((entry["generation"], entry["world_size"]))
    assert sorted(shares) == list(range(STEPS))
    assert generations[0] == {(1, FIRST_WORLD)} and generations[STEPS - 1] == {(2, SECOND_WORLD)}
    stop_step = min(step for step in shares if generations[step] == {(2, SECOND_WORLD)})
    assert 0 < stop_step < STEPS

    stream = SampleStream(SAMPLES, SEED)
    seen: list[int] = []
    for step in range(STEPS):
        generation, world_size = (1, FIRST_WORLD) if step < stop_step else (2, SECOND_WORLD)
        assert generations[step] == {(generation, world_size)}
        assert sorted(shares[step]) == list(range(world_size))
        batch = [index for rank in range(world_size) for index in shares[step][rank]]
        assert batch == stream.global_batch(step, BATCH).tolist()
        seen.extend(batch)
    epoch_zero, epoch_one, epoch_two = seen[:SAMPLES], seen[SAMPLES : 2 * SAMPLES], seen[2 * SAMPLES :]
    assert Counter(epoch_zero) == Counter(range(SAMPLES)) == Counter(epoch_one)
    assert epoch_two == stream.positions(2 * SAMPLES, STEPS * BATCH).tolist()
