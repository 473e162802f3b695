"""Hybrid mode with real workers: the digits CNN trained through resizes 3 -> 1 -> 2, its
global batch and learning rate following the workers (with the warm-up ramp at every change),
reaches the held-out accuracy of the same job on a fixed 3 workers within one point; the job
reports its batch and rate as they change, and every sample of the stream is trained once, in
order, whatever the batch of the step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from elastic.spec import JobSpec
from elastic.tasks.runtime import bind_task
from elastic.worker import COMPLETED_EXIT_CODE
from elastic.worker.checkpoint import TrainingState, checkpoint_path, load_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from elastic.workloads import CATALOGUE
from tests.worker_support import DIGITS_SAMPLES, REDIS_URL, worker_env

pytestmark = pytest.mark.slow

SEED = 8
SPEC = {
    "name": "hybrid-cnn",
    "workload": "digits-cnn",
    "min_workers": 1,
    "max_workers": 3,
    "consistency": "hybrid",
    "batch_per_worker": 16,
    "min_batch_size": 16,
    "max_batch_size": 48,
    "lr_scaling": "linear",
    "warmup_steps": 20,
    "seed": SEED,
    "hyperparameters": {"batch_size": 48, "channels": 8, "lr": 0.05},
}
TARGET_ACCURACY = 0.94
TAIL_STEPS = 300
"""Held-out accuracy wobbles by about a point from one step to the next on these 360 images at a
constant rate, so each run is judged by the mean over the checkpoints of its last TAIL_STEPS."""


def accuracy_of(state: TrainingState) -> float:
    """The accuracy of the checkpoint's model on the digits the job never trained on."""
    info = CATALOGUE[SPEC["workload"]]
    problem = bind_task(info.path, info.entrypoint, SPEC["hyperparameters"], SEED)
    problem.model.load_state_dict(state.model)
    return problem.evaluate()["accuracy"]


class CheckpointWatch:
    """Evaluates each new periodic checkpoint of a run (rank 0 writes one every 0.2 s)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = checkpoint_path(run_dir)
        self.accuracy: dict[int, float] = {}

    def poll(self) -> None:
        try:
            state = load_checkpoint(self.path)
        except (OSError, RuntimeError, EOFError):  # replaced while read
            return
        if state is not None and state.step not in self.accuracy:
            self.accuracy[state.step] = accuracy_of(state)

    def mean_from(self, first_step: int) -> float:
        tail = [accuracy for step, accuracy in self.accuracy.items() if step >= first_step]
        assert len(tail) >= 5, f"only {len(tail)} checkpoints after step {first_step}"
        return sum(tail) / len(tail)


def test_hybrid_resizes_reach_the_fixed_runs_accuracy(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record), BUNGEE_CHECKPOINT_EVERY_S="0.2")
    resized_watch = CheckpointWatch(tmp_path / "resized")
    with LocalJob({**SPEC, "steps": 10_000_000}, tmp_path / "resized", REDIS_URL, env=env) as job:

        def after_progress(generation: int, steps: int) -> int:
            _, formed = job.wait_for(lambda _, e: e.kind == "resized" and e.generation == generation, 180)
            target = (formed.step or 0) + steps
            while True:
                resized_watch.poll()
                try:
                    _, event = job.wait_for(
                        lambda _, e: (
                            e.kind == "progress" and e.generation == generation and (e.step or 0) >= target
                        ),
                        0.1,
                    )
                    return event.step or 0
                except TimeoutError:
                    continue

        job.start([0, 1, 2])
        after_progress(1, 100)
        job.resize([0])
        after_progress(2, 100)
        job.resize([0, 1])
        after_progress(3, 500)
        job.send_signal(0, signal.SIGTERM)
        job.wait(120)
    resized = load_checkpoint(checkpoint_path(tmp_path / "resized"))
    assert resized is not None
    steps = resized.step
    resized_watch.accuracy[steps] = accuracy_of(resized)

    progress = [e for o in job.outputs for e in o.of_kind("progress")]
    by_generation = {e.generation: e for e in progress}  # the last report of each
    assert [by_generation[g].global_batch for g in (1, 2, 3)] == [48, 16, 32]
    assert by_generation[2].lr == pytest.approx(0.05 / 3) and by_generation[3].lr == pytest.approx(0.1 / 3)
    ramping = [e.lr for e in progress if e.generation == 3 and e.lr is not None]
    assert ramping == sorted(ramping) and ramping[0] < ramping[-1], "the rate rises over the warm-up"

    # Consecutive steps train consecutive runs of the stream, whatever their batch.
    batches: dict[int, list[tuple[int, list[int]]]] = {}
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
    fixed_watch = CheckpointWatch(fixed_dir)
    fixed_env = worker_env(BUNGEE_CHECKPOINT_EVERY_S="0.2")
    with LocalJob({**SPEC, "steps": steps}, fixed_dir, REDIS_URL, env=fixed_env, heal=False) as fixed_job:
        fixed_job.start([0, 1, 2])
        while fixed_job.live() or not fixed_job.outputs:
            fixed_watch.poll()
            time.sleep(0.05)
        outputs = fixed_job.wait(300)
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE] * 3, fixed_job.describe()
    fixed_watch.poll()
    assert max(fixed_watch.accuracy) == steps
    JobSpec(**SPEC, steps=steps)  # the spec the test ran is one a user may submit

    first = steps - TAIL_STEPS
    resized_accuracy, fixed_accuracy = resized_watch.mean_from(first), fixed_watch.mean_from(first)
    assert fixed_accuracy >= TARGET_ACCURACY
    assert abs(resized_accuracy - fixed_accuracy) <= 0.01, (resized_accuracy, fixed_accuracy)
