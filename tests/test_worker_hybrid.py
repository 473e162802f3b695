"""Hybrid mode with real workers: the digits CNN trained through resizes 4 -> 2 -> 3 -> 4, its
global batch and learning rate following the workers (with the warm-up ramp at every change),
reaches the held-out accuracy of the same job on a fixed 4 workers within one point; the job
reports its batch and rate as they change, and every sample of the stream is trained once, in
order, whatever the batch of the step."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from elastic.spec import JobSpec
from elastic.worker import COMPLETED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, checkpoint_path, load_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from elastic.workloads import CATALOGUE
from elastic.workloads.digits import held_out_accuracy
from tests.worker_support import DIGITS_SAMPLES, REDIS_URL, worker_env

pytestmark = pytest.mark.slow

SEED = 8
SPEC = {
    "name": "hybrid-cnn",
    "workload": "digits-cnn",
    "min_workers": 1,
    "max_workers": 4,
    "consistency": "hybrid",
    "batch_per_worker": 16,
    "min_batch_size": 16,
    "max_batch_size": 64,
    "lr_scaling": "linear",
    "warmup_steps": 20,
    "seed": SEED,
    "hyperparameters": {"batch_size": 64, "channels": 8, "lr": 0.05},
}
TARGET_ACCURACY = 0.95


def accuracy_of(state: TrainingState) -> float:
    """The accuracy of the checkpoint's model on the digits the job never trained on."""
    info = CATALOGUE[SPEC["workload"]]
    problem = info.build(info.hyperparameters.model_validate(SPEC["hyperparameters"]), SEED)
    problem.model.load_state_dict(state.model)
    return held_out_accuracy(problem.model, (-1, 1, 8, 8))


def test_hybrid_resizes_reach_the_fixed_runs_accuracy(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record))
    with LocalJob({**SPEC, "steps": 10_000_000}, tmp_path / "resized", REDIS_URL, env=env) as job:

        def after_progress(generation: int, steps: int) -> int:
            _, formed = job.wait_for(lambda _, e: e.kind == "resized" and e.generation == generation, 180)
            target = (formed.step or 0) + steps
            _, event = job.wait_for(
                lambda _, e: e.kind == "progress" and e.generation == generation and (e.step or 0) >= target,
                180,
            )
            return event.step or 0

        job.start([0, 1, 2, 3])
        after_progress(1, 60)
        job.resize([0, 1])
        after_progress(2, 60)
        job.resize([0, 1, 2])
        after_progress(3, 60)
        job.resize([0, 1, 2, 3])
        after_progress(4, 400)
        job.send_signal(0, signal.SIGTERM)
        job.wait(120)
    resized = load_checkpoint(checkpoint_path(tmp_path / "resized"))
    assert resized is not None
    steps = resized.step

    progress = [e for o in job.outputs for e in o.of_kind("progress")]
    by_generation = {e.generation: e for e in progress}  # the last report of each
    assert [by_generation[g].global_batch for g in (1, 2, 3, 4)] == [64, 32, 48, 64]
    assert by_generation[2].lr == pytest.approx(0.025) and by_generation[3].lr == pytest.approx(0.0375)
    ramping = [e.lr for e in progress if e.generation == 3 and e.lr is not None]
    assert ramping == sorted(ramping), "the rate rises from 0.025 towards 0.0375 over the warm-up"

    # Consecutive steps train consecutive runs of the stream, whatever their batch.
    batches: dict[int, list[int]] = {}
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        batches.setdefault(entry["step"], []).append((entry["rank"], entry["indices"]))
    stream = SampleStream(DIGITS_SAMPLES, SEED)
    position = 0
    for step in range(steps):
        indices = [index for _, share in sorted(batches[step]) for index in share]
        assert indices == stream.positions(position, position + len(indices)).tolist(), step
        position += len(indices)
    assert resized.trainer["position"] == position

    fixed_dir = tmp_path / "fixed"
    with LocalJob({**SPEC, "steps": steps}, fixed_dir, REDIS_URL, env=worker_env(), heal=False) as fixed_job:
        fixed_job.start([0, 1, 2, 3])
        outputs = fixed_job.wait(300)
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE] * 4, fixed_job.describe()
    fixed = load_checkpoint(checkpoint_path(fixed_dir))
    assert fixed is not None and fixed.step == steps
    JobSpec(**SPEC, steps=steps)  # the spec the test ran is one a user may submit

    resized_accuracy, fixed_accuracy = accuracy_of(resized), accuracy_of(fixed)
    assert fixed_accuracy >= TARGET_ACCURACY
    assert abs(resized_accuracy - fixed_accuracy) <= 0.01, (resized_accuracy, fixed_accuracy)
