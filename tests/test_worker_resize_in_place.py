"""Real workers resized in place, 2 -> 3 -> 1 -> 2, while they train: survivors are never
restarted (same pid through every generation), joiners get the state from the survivors' memory
(bytes moved, no checkpoint read), leavers exit with LEFT_EXIT_CODE, and across it all every step
trains on exactly its global batch, each step once, and the loss falls."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic.worker import LEFT_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import checkpoint_path, load_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from tests.worker_support import DIGITS_SAMPLES, REDIS_URL, Ledger, worker_env

pytestmark = pytest.mark.slow

BATCH = 32
VIRTUAL_WORKERS = 3
"""Strict mode (the default), one virtual worker per worker at the most workers."""
SEED = 5
SPEC = {
    "name": "in-place",
    "workload": "digits-mlp",
    "steps": 1_000_000,
    "seed": SEED,
    "max_workers": VIRTUAL_WORKERS,
    "hyperparameters": {"batch_size": BATCH, "hidden": 128},
}


def test_2_3_1_2_in_place(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    # Paced (compute stretched 4x, sleeping): the survivors train fewer steps while joiners start.
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record), BUNGEE_SIM_SLOWDOWN="4")
    with LocalJob(SPEC, tmp_path / "run", REDIS_URL, env=env) as job:
        job.start([0, 1])
        job.wait_for(lambda _, e: e.kind == "resized" and e.generation == 1, 120)
        resized = {}
        for generation, slots in ((2, [0, 1, 2]), (3, [2]), (4, [2, 0])):
            job.wait_for(lambda _, e, g=generation - 1: e.kind == "progress" and e.generation == g, 60)
            assert job.resize(slots).generation == generation
            _, resized[generation] = job.wait_for(
                lambda _, e, g=generation: e.kind == "resized" and e.generation == g, 120
            )
        last = job.wait_for(lambda _, e: e.kind == "progress" and e.generation == 4, 60)[1]
        job.send_signal(2, signal.SIGTERM)
        outputs = job.wait(60)

    first_0, first_1, joiner_2, second_0 = outputs
    assert [o.slot for o in outputs] == [0, 1, 2, 0], job.describe()
    # Survivors: one process each through every generation it was in, under every rank it had.
    joined = {o.pid: [(e.generation, e.rank) for e in o.of_kind("joined")] for o in outputs}
    assert joined[first_0.pid] == [(1, 0), (2, 0)]
    assert joined[first_1.pid] == [(1, 1), (2, 1)]
    assert joined[joiner_2.pid] == [(2, 2), (3, 0), (4, 0)]
    assert joined[second_0.pid] == [(4, 1)]
    assert all(e.pid == o.pid for o in outputs for e in o.of_kind("joined"))
    assert (first_0.returncode, first_1.returncode) == (LEFT_EXIT_CODE, LEFT_EXIT_CODE), job.describe()
    assert (joiner_2.returncode, second_0.returncode) == (STOPPED_EXIT_CODE, STOPPED_EXIT_CODE), (
        job.describe()
    )
    assert any("left the job" in m for m in first_0.log_messages())

    # The resize reports: who, what moved, what it cost.
    assert resized[2].members_before == ["local/0", "local/1"]
    assert resized[2].members_after == ["local/0", "local/1", "local/2"]
    assert resized[3].members_after == ["local/2"] and resized[4].members_after == ["local/2", "local/0"]
    state_bytes = resized[2].bytes_moved
    parameters = 64 * 128 + 128 + 128 * 10 + 10
    # The parameters and their momentum, float32; a tensor of a few elements rides in the outline.
    assert state_bytes is not None and 0.99 * 8 * parameters < state_bytes <= 8 * parameters
    assert resized[3].bytes_moved == 0 and resized[4].bytes_moved == state_bytes
    for event in resized.values():
        assert event.pause_s is not None and event.pause_s >= 0
        assert event.phases and {"rendezvous", "first_step"} <= set(event.phases)
    assert {"exchange", "transfer"} <= set(resized[2].phases or {})

    # Every step once, on exactly its batch; the last one is the one all stopped after.
    ledger = Ledger.read(record)
    assert ledger.generations() == [1, 2, 3, 4]
    stream = SampleStream(DIGITS_SAMPLES, SEED)
    stop_step = ledger.check(stream, BATCH, virtual_workers=VIRTUAL_WORKERS)
    saved = load_checkpoint(checkpoint_path(tmp_path / "run"))
    assert saved is not None and saved.step == stop_step >= (last.step or 0)
    for step, record_ in ledger.steps.items():
        assert step < resized[2].step or record_.generation >= 2  # each generation from its switch on
    # It learned across it all.
    losses = [e.loss for o in outputs for e in o.of_kind("progress") if e.loss is not None]
    assert losses[-1] < losses[0] / 2, losses
