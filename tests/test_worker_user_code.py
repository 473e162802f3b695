"""A user's own task (tests/tasks/rings: batch norm, dropout, its own Dataset over a file it
ships, its own collate and metrics), run by real worker processes from its own directory.

In strict mode, with a learning-rate scheduler, resized 2 -> 3 -> (a worker SIGKILLed) 2 -> 1 in
place, it ends `torch.equal` to
the same task on a fixed 2 workers, every sample of every step trained exactly once, and the
model file it leaves loads without Bungee and gives its manifest's evaluation. In hybrid mode,
resized 3 -> 1 -> 2, its batch follows the workers over a contiguous sample stream. A bug in
its `loss` at the fifth call fails the worker with the job's own traceback in the log and exit
code USER_ERROR_EXIT_CODE, and the job is not healed into a restart loop."""

from __future__ import annotations

import io
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.artifacts import MANIFEST_NAME, MODEL_NAME, Manifest, artifacts_dir
from elastic.codepack import pack_directory
from elastic.worker import COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE, WHOLE_TRACEBACK_HEAD
from elastic.worker.checkpoint import checkpoint_path, load_checkpoint
from elastic.worker.data import SampleStream
from elastic.worker.local import LocalJob
from tests.code_support import evaluate_without_bungee
from tests.test_worker_strict_consistency import _differences, _losses
from tests.worker_support import REDIS_URL, Ledger, worker_env

pytestmark = pytest.mark.slow

RINGS = (Path(__file__).parent / "tasks" / "rings", "task:RingsTask")
RING_SAMPLES = 600
SEED = 5
BATCH = 24
SPEC: dict[str, Any] = {
    "name": "rings",
    # LocalJob hands the workers the directory, as an agent does once it has unpacked the code.
    "code": pack_directory(RINGS[0], io.BytesIO(), 10**8, 1000).digest,
    "entrypoint": RINGS[1],
    "max_workers": 3,
    "seed": SEED,
    "hyperparameters": {"batch_size": BATCH, "hidden": 16, "dropout": 0.2, "lr_decay_every": 50},
}


def test_a_users_task_resized_in_place_is_bitwise_the_fixed_run(tmp_path: Path) -> None:
    record = tmp_path / "samples.jsonl"
    # Paced (compute stretched 4x, sleeping): the survivors train fewer steps while joiners
    # start, and the fixed run repeats every one of them.
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record), BUNGEE_SIM_SLOWDOWN="4")
    spec = {**SPEC, "steps": 10_000_000}
    with LocalJob(spec, tmp_path / "resized", REDIS_URL, env=env, task=RINGS) as job:
        job.start([0, 1])
        job.trained_past(1, 5)
        job.resize([0, 1, 2])
        job.trained_past(2, 5)
        job.send_signal(1, signal.SIGKILL)  # the job heals: generation 3 is slots 0 and 2
        job.trained_past(3, 5)
        job.resize([2])
        job.trained_past(4, 5)
        job.send_signal(2, signal.SIGTERM)
        job.wait(120)
    assert [r.world_size for r in job.records] == [2, 3, 2, 1], job.describe()
    assert job.worker_on(2).returncode == STOPPED_EXIT_CODE, job.describe()
    assert len(job.outputs) == 3, "the survivors were never restarted"
    resized = load_checkpoint(checkpoint_path(tmp_path / "resized"))
    assert resized is not None and resized.step > 20
    steps = Ledger.read_all(record, 1)
    last_pass = Ledger({step: records[-1] for step, records in steps.items()})
    assert last_pass.check(SampleStream(RING_SAMPLES, SEED), BATCH, partial=1, virtual_workers=3) >= resized.step

    fixed_record = tmp_path / "fixed.jsonl"
    fixed_env = worker_env(BUNGEE_RECORD_SAMPLES=str(fixed_record))
    fixed_spec = {**SPEC, "steps": resized.step}
    with LocalJob(fixed_spec, tmp_path / "fixed", REDIS_URL, env=fixed_env, heal=False, task=RINGS) as fixed_job:
        fixed_job.start([0, 1])
        outputs = fixed_job.wait(300)
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE] * 2, fixed_job.describe()
    fixed = load_checkpoint(checkpoint_path(tmp_path / "fixed"))
    assert fixed is not None and fixed.step == resized.step
    assert _differences(resized, fixed) == []
    assert _losses(record)[: resized.step] == _losses(fixed_record)

    # What each leaves its owner: the model file is the same bit for bit (strict mode exports
    # virtual worker 0's buffers whatever the world size), and it loads without Bungee into the
    # task's own class, giving the manifest's evaluation exactly.
    resized_dir, fixed_dir = artifacts_dir(tmp_path / "resized"), artifacts_dir(tmp_path / "fixed")
    resized_model = torch.load(resized_dir / MODEL_NAME, weights_only=True)
    fixed_model = torch.load(fixed_dir / MODEL_NAME, weights_only=True)
    assert resized_model.keys() == fixed_model.keys()
    assert all(torch.equal(resized_model[name], fixed_model[name]) for name in fixed_model)
    manifest = json.loads((fixed_dir / MANIFEST_NAME).read_text())
    assert (manifest["ended"], manifest["step"], manifest["job_id"]) == ("completed", resized.step, 1)
    assert json.loads((resized_dir / MANIFEST_NAME).read_text())["ended"] == "stopped"
    assert set(manifest["final"]["metrics"]) == {"accuracy", "loss"}
    assert evaluate_without_bungee(fixed_dir / MODEL_NAME, fixed_dir / MANIFEST_NAME) == manifest["final"]["metrics"]
    # What it was trained with: the node's Python and torch build, and no packages of its own.
    assert manifest["environment"] == {"python": sys.version, "torch": torch.__version__,
                                       "torch_cuda": torch.version.cuda, "own_packages": None}
    assert Manifest.model_validate(manifest).environment is not None


def test_a_users_task_in_hybrid_mode_resized_in_place(tmp_path: Path) -> None:
    # Hybrid: the global batch follows the workers (8 a worker), consecutive steps train
    # consecutive runs of the sample stream whatever their batch, and the model learns.
    record = tmp_path / "samples.jsonl"
    env = worker_env(BUNGEE_RECORD_SAMPLES=str(record))
    spec = {
        **SPEC, "steps": 10_000_000, "consistency": "hybrid", "batch_per_worker": 8, "min_batch_size": 8,
        "max_batch_size": 24, "warmup_steps": 5, "eval_every_steps": 25,
    }
    with LocalJob(spec, tmp_path / "run", REDIS_URL, env=env, task=RINGS) as job:
        job.start([0, 1, 2])
        job.trained_past(1, 40)
        job.resize([0])
        job.trained_past(2, 40)
        job.resize([0, 1])
        job.trained_past(3, 150)
        job.send_signal(0, signal.SIGTERM)
        job.wait(120)
    assert [r.world_size for r in job.records] == [3, 1, 2] and len(job.outputs) == 4, job.describe()
    progress = {e.generation: e for o in job.outputs for e in o.of_kind("progress")}
    assert [progress[g].global_batch for g in (1, 2, 3)] == [24, 8, 16]
    state = load_checkpoint(checkpoint_path(tmp_path / "run"))
    assert state is not None
    batches: dict[int, list[tuple[int, list[int]]]] = {}
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        batches.setdefault(entry["step"], []).append((entry["rank"], entry["indices"]))
    stream, position = SampleStream(RING_SAMPLES, SEED), 0
    for step in range(state.step):
        indices = [index for _, share in sorted(batches[step]) for index in share]
        assert indices == stream.positions(position, position + len(indices)).tolist(), step
        position += len(indices)
    manifest = json.loads((artifacts_dir(tmp_path / "run") / MANIFEST_NAME).read_text())
    assert manifest["ended"] == "stopped" and manifest["final"]["metrics"]["accuracy"] >= 0.9, manifest["final"]
    # The task's named metrics: its loss's on every progress report, its evaluation every 25
    # steps and at the end (the last one is the manifest's).
    reports = [e for o in job.outputs for e in o.of_kind("progress")]
    assert reports and all(set(e.metrics or {}) == {"accuracy"} for e in reports)
    evaluations = [e for o in job.outputs for e in o.of_kind("evaluation")]
    assert [e.step for e in evaluations][:-1] == list(range(25, state.step, 25))
    assert evaluations[-1].step == state.step and evaluations[-1].metrics == manifest["final"]["metrics"]


def test_a_bug_in_loss_fails_the_worker_once_with_the_traceback(tmp_path: Path) -> None:
    # One worker hosting the 3 virtual workers: a warm-up call, then 3 calls a step; the 11th
    # is in step 3 (0-based). (The portal's side, failing the job and stopping the other
    # workers, is in test_generation_lifecycle.)
    spec = {**SPEC, "steps": 1000, "hyperparameters": {**SPEC["hyperparameters"], "fail_at_call": 11}}
    with LocalJob(spec, tmp_path / "run", REDIS_URL, env=worker_env(), task=RINGS) as job:
        job.start([0])
        outputs = job.wait(120)
    assert [o.returncode for o in outputs] == [USER_ERROR_EXIT_CODE], job.describe()
    [failure] = [m for m in outputs[0].log_messages() if m.startswith("the job's code failed")]
    assert "loss(model, batch) raised ValueError: the task's own bug, at call 11" in failure
    # The task's own frames, named as in its directory; the platform's in the next line only.
    assert "Traceback (most recent call last)" in failure and 'File "task.py", line' in failure
    assert "elastic/" not in failure, failure
    [whole] = [m for m in outputs[0].log_messages() if m.startswith(WHOLE_TRACEBACK_HEAD)]
    assert "elastic/tasks/runtime.py" in whole and "rings/task.py" in whole
    # Its exit announces the failure as a typed field, which the agent reports and the portal
    # quotes in the job's message: the error and the task's own frames only.
    [exiting] = outputs[0].of_kind("exiting")
    assert exiting.exit_code == USER_ERROR_EXIT_CODE and exiting.user_error is not None
    assert exiting.user_error.error == "loss(model, batch) raised ValueError: the task's own bug, at call 11"
    assert 'File "task.py", line' in exiting.user_error.traceback and "elastic/" not in exiting.user_error.traceback
    # What it trained is not lost: the state of the last completed step, as the job's artifacts.
    directory = artifacts_dir(tmp_path / "run")
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert (manifest["ended"], manifest["step"]) == ("failed", 3)
    saved = load_checkpoint(checkpoint_path(tmp_path / "run"))
    model = torch.load(directory / MODEL_NAME, weights_only=True)
    assert saved is not None and saved.step == 3
    assert all(torch.equal(model[name], saved.model[name]) for name in model)
    assert [e.step for e in outputs[0].of_kind("artifacts")] == [3]
    # The last progress it reported is that step too, whatever the rate limit held back: the
    # job fails at the step its artifacts hold (the page once said 94, the manifest 99).
    assert outputs[0].of_kind("progress")[-1].step == 3


def test_the_jobs_own_exit_handlers_run_when_its_worker_ends(tmp_path: Path) -> None:
    # The worker leaves without the interpreter's teardown, but it runs what the job registered
    # with atexit first.
    marker = tmp_path / "exited"
    spec = {**SPEC, "steps": 3, "hyperparameters": {**SPEC["hyperparameters"], "exit_marker": str(marker)}}
    with LocalJob(spec, tmp_path / "run", REDIS_URL, env=worker_env(), task=RINGS) as job:
        job.start([0])
        outputs = job.wait(120)
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE], job.describe()
    assert marker.exists(), "the job's atexit handler did not run"
    words = marker.read_text().split()
    assert words[:2] == ["loss", "called"] and int(words[2]) >= 3, "it ran before the job trained"


def test_a_stop_while_the_job_builds_ends_the_worker_at_once(tmp_path: Path) -> None:
    # The job's model() takes ten minutes; the worker is stopped while it runs. A worker still
    # starting holds no training state: it goes at once, without waiting for its build to end.
    marker = tmp_path / "building"
    slow = {"slow_model_s": 600.0, "slow_model_marker": str(marker)}
    spec = {**SPEC, "steps": 1000, "hyperparameters": {**SPEC["hyperparameters"], **slow}}
    with LocalJob(spec, tmp_path / "run", REDIS_URL, env=worker_env(), task=RINGS) as job:
        job.start([0])
        job.wait_until(marker.exists, timeout_s=120)
        job.send_signal(0, signal.SIGTERM)
        outputs = job.wait(60)
    assert [o.returncode for o in outputs] == [STOPPED_EXIT_CODE], job.describe()
    messages = outputs[0].log_messages()
    assert not [m for m in messages if m.startswith("built in")], messages
    [stopped] = [m for m in messages if "while starting" in m]
    assert stopped.startswith("stopped by SIGTERM while starting, after ") and stopped.endswith(
        "it held no training state"
    ), stopped
    assert "Traceback" not in outputs[0].stderr, outputs[0].stderr
