"""Failures with real workers: a checkpoint of another job fails the worker with a traceback; a
survivor SIGKILLed mid-step costs at most the step in flight (its peers notice at once, keep the
state of the last completed step and go on in the next generation); a joiner killed while warming
up does not disturb the job; when every worker dies the job resumes from its periodic checkpoint
and says so. Each run ends with every step trained on exactly its batch."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from elastic.worker import FAILED_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, checkpoint_path, save_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from tests.worker_support import DIGITS_SAMPLES, REDIS_URL, Ledger, worker_env

pytestmark = pytest.mark.slow

BATCH = 32
VIRTUAL_WORKERS = 3
"""Strict mode (the default), one virtual worker per worker at the most workers."""
SEED = 9
SPEC = {
    "name": "failure",
    "workload": "digits-mlp",
    "steps": 1_000_000,
    "seed": SEED,
    "max_workers": VIRTUAL_WORKERS,
    "hyperparameters": {"batch_size": BATCH},
}


def _progress_after(job: LocalJob, generation: int, steps: int = 20) -> int:
    """Waits until generation `generation` trained `steps` steps past its start; returns the step."""
    return job.trained_past(generation, steps, form_s=120, train_s=60)


def _stop(job: LocalJob, slot: int) -> None:
    job.send_signal(slot, signal.SIGTERM)
    job.wait(60)


def test_checkpoint_of_another_workload_fails_the_worker(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    foreign = TrainingState(5, "digits-cnn", 0, model.state_dict(), {"state": {}, "param_groups": []})
    save_checkpoint(checkpoint_path(tmp_path), foreign)
    with LocalJob(SPEC, tmp_path, REDIS_URL, env=worker_env(), heal=False) as job:
        job.start([0])
        [output] = job.wait(120)
    assert output.returncode == FAILED_EXIT_CODE
    assert "Traceback" in output.stderr
    assert "CheckpointError: checkpoint is of workload 'digits-cnn' seed 0" in output.stderr


def test_a_survivor_killed_mid_step_costs_at_most_that_step(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    with LocalJob(
        SPEC, tmp_path / "run", REDIS_URL, env=worker_env(BUNGEE_RECORD_SAMPLES=str(record))
    ) as job:
        job.start([0, 1, 2])
        before = _progress_after(job, 1)
        victim = job.worker_on(1)
        survivors = [job.worker_on(0).pid, job.worker_on(2).pid]
        job.send_signal(1, signal.SIGKILL)
        after = _progress_after(job, 2)
        _stop(job, 0)
    assert victim.returncode == -signal.SIGKILL
    assert [o.pid for o in job.outputs if o.returncode == STOPPED_EXIT_CODE] == survivors, job.describe()
    assert job.records[1].keys() == ["local/0", "local/2"] and job.records[1].has_state
    lost = [m for o in job.outputs for m in o.log_messages() if m.startswith("lost a peer")]
    assert len(lost) == 2, "both survivors noticed"
    ledger = Ledger.read(record)
    assert ledger.generations() == [1, 2]
    steps = ledger.check(
        SampleStream(DIGITS_SAMPLES, SEED), BATCH, partial=1, virtual_workers=VIRTUAL_WORKERS
    )
    assert before < steps and after <= steps


def test_a_joiner_killed_while_warming_up_does_not_disturb_the_job(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    # Workers started as new interpreters: a forked one is past its imports in milliseconds.
    with LocalJob(
        SPEC, tmp_path / "run", REDIS_URL, env=worker_env(BUNGEE_RECORD_SAMPLES=str(record)), fork=False
    ) as job:
        job.start([0, 1])
        _progress_after(job, 1)
        job.resize([0, 1, 2])
        joiner = job.worker_on(2)
        time.sleep(0.5)  # importing torch
        job.send_signal(2, signal.SIGKILL)
        job.wait_until(lambda: joiner.returncode is not None)
        marked = [e for o in job.outputs for e in o.events if e.kind == "progress"]
        _progress_after(job, 3)
        _stop(job, 0)
    assert joiner.returncode == -signal.SIGKILL and not joiner.of_kind("joined")
    # Generation 2 never formed; 3 is the same two workers, who never stopped training.
    assert [r.keys() for r in job.records] == [
        ["local/0", "local/1"],
        ["local/0", "local/1", "local/2"],
        ["local/0", "local/1"],
    ]
    assert [o.returncode for o in job.outputs if o.slot != 2] == [STOPPED_EXIT_CODE] * 2
    steps_during = [e.step for e in marked if e.generation == 1]
    assert len(steps_during) >= 2 and steps_during == sorted(steps_during)
    ledger = Ledger.read(record)
    assert ledger.generations() == [1, 3]
    ledger.check(SampleStream(DIGITS_SAMPLES, SEED), BATCH, virtual_workers=VIRTUAL_WORKERS)


def test_every_worker_killed_resumes_from_the_periodic_checkpoint(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record), BUNGEE_CHECKPOINT_EVERY_S="0.2")
    with LocalJob(SPEC, tmp_path / "run", REDIS_URL, env=env) as job:
        job.start([0, 1])
        _progress_after(job, 1, steps=200)
        time.sleep(0.5)  # a periodic checkpoint or two
        for output in job.live():
            os.kill(output.pid, signal.SIGKILL)
        _, resumed = job.wait_for(
            lambda _, e: e.kind == "log" and "periodic checkpoint" in (e.message or ""), 120
        )
        generation = resumed.generation
        killed_at = max(Ledger.read_all(record))
        job.wait_for(lambda _, e: e.kind == "progress" and (e.step or 0) > killed_at + 20, 120)
        _stop(job, 0)
    assert job.records[-1].generation == generation and not job.records[-1].has_state
    message = resumed.message or ""
    assert message.startswith("resumed from the periodic checkpoint at step ")
    assert "no running worker held the training state" in message
    restored = int(message.split("at step ")[1].split(" ")[0])
    ledger = Ledger.read_all(record)
    assert 0 < restored <= killed_at + 1
    # The steps after the checkpoint were trained again, on exactly the same samples.
    stream = SampleStream(DIGITS_SAMPLES, SEED)
    again = Ledger({step: records[-1] for step, records in ledger.items()})
    assert again.check(stream, BATCH, partial=1, virtual_workers=VIRTUAL_WORKERS) > restored
    assert all(records[-1].generation == generation for step, records in ledger.items() if step >= restored)
