"""Real worker processes on CPU: a fixed two-worker run completes and learns; a scale-in from two
workers to one, in place, ends with the parameters of the fixed run; a SIGTERM to one rank stops
every rank after the same step with that step saved, and a new job on one worker resumes from it
and ends with the fixed run's parameters too."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from elastic.worker import COMPLETED_EXIT_CODE, LEFT_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import checkpoint_path, load_checkpoint
from elastic.worker.local import LocalJob, WorkerOutput
from tests.worker_support import REDIS_URL, worker_env

pytestmark = pytest.mark.slow

TOTAL_STEPS = 600
# Strict mode (the default) with 2 virtual workers, so a 2-then-1 run is the same computation as
# a 2-worker run (test_worker_strict_consistency shows it bit for bit, dropout included; here
# the stop and the checkpoint are what is tested, without dropout as before).
SPEC = {
    "name": "stop-resume",
    "workload": "digits-mlp",
    "steps": TOTAL_STEPS,
    "max_workers": 2,
    "hyperparameters": {"dropout": 0.0},
}


def _describe(outputs: list[WorkerOutput]) -> str:
    return "\n".join(f"slot {o.slot} exit {o.returncode}: {o.log_messages()} {o.stderr}" for o in outputs)


def _assert_same_parameters(run_dir: Path, fixed_dir: Path) -> None:
    final = load_checkpoint(checkpoint_path(run_dir))
    fixed = load_checkpoint(checkpoint_path(fixed_dir))
    assert final is not None and fixed is not None and final.step == fixed.step == TOTAL_STEPS
    for name, tensor in fixed.model.items():
        assert torch.allclose(final.model[name], tensor, rtol=1e-5, atol=1e-5), name


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[WorkerOutput]]:
    run_dir = tmp_path_factory.mktemp("fixed")
    with LocalJob(SPEC, run_dir, REDIS_URL, env=worker_env(), heal=False) as job:
        job.start([0, 1])
        return run_dir, job.wait(180)


def test_fixed_run_completes_and_learns(fixed_run: tuple[Path, list[WorkerOutput]]) -> None:
    run_dir, outputs = fixed_run
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE] * 2, _describe(outputs)
    leader, follower = outputs
    progress = leader.of_kind("progress")
    assert not follower.of_kind("progress")
    assert progress[0].step == 1 and progress[-1].step == TOTAL_STEPS
    assert all(event.total_steps == TOTAL_STEPS for event in progress)
    assert progress[-1].epoch == pytest.approx(TOTAL_STEPS * 64 / 1437)
    assert progress[-1].loss is not None and progress[0].loss is not None
    assert progress[-1].loss < progress[0].loss / 4
    assert all(event.samples_per_s and event.samples_per_s > 0 for event in progress)
    built, started = leader.log_messages()[:2]
    assert built.startswith("built in ") and "the model and data" in built, "the start-up line comes first"
    assert started == f"starting from step 0 of {TOTAL_STEPS}, world size 2"
    state = load_checkpoint(checkpoint_path(run_dir))
    assert state is not None and state.step == TOTAL_STEPS


def test_scale_in_in_place_matches_the_fixed_run(
    fixed_run: tuple[Path, list[WorkerOutput]], tmp_path: Path
) -> None:
    with LocalJob(SPEC, tmp_path, REDIS_URL, env=worker_env(), heal=False) as job:
        job.start([0, 1])
        job.wait_for(lambda _, e: e.kind == "progress" and e.generation == 1)
        job.resize([0])
        outputs = job.wait(180)
    assert [o.returncode for o in outputs] == [COMPLETED_EXIT_CODE, LEFT_EXIT_CODE], _describe(outputs)
    [switch] = outputs[0].of_kind("resized")[1:]
    assert switch.generation == 2 and 0 < (switch.step or 0) < TOTAL_STEPS
    assert load_checkpoint(checkpoint_path(tmp_path)) is not None
    _assert_same_parameters(tmp_path, fixed_run[0])


def test_stop_then_resume_on_fewer_workers_matches_the_fixed_run(
    fixed_run: tuple[Path, list[WorkerOutput]], tmp_path: Path
) -> None:
    with LocalJob(SPEC, tmp_path, REDIS_URL, env=worker_env(), heal=False) as job:
        job.start([0, 1])
        job.wait_for(lambda _, e: e.kind == "progress")
        job.send_signal(1, signal.SIGTERM)
        stopped = job.wait()
    assert [o.returncode for o in stopped] == [STOPPED_EXIT_CODE] * 2, _describe(stopped)
    saved = load_checkpoint(checkpoint_path(tmp_path))
    assert saved is not None and 0 < saved.step < TOTAL_STEPS
    assert stopped[0].log_messages()[-1] == f"stopping at step {saved.step}"
    assert stopped[0].of_kind("progress")[-1].step == saved.step

    with LocalJob(SPEC, tmp_path, REDIS_URL, env=worker_env(), heal=False) as job:
        job.start([0])
        [resumed] = job.wait(180)
    assert resumed.returncode == COMPLETED_EXIT_CODE, _describe([resumed])
    assert resumed.log_messages()[0].startswith("built in ")
    assert resumed.log_messages()[1] == (
        f"resumed from the periodic checkpoint at step {saved.step} of {TOTAL_STEPS}, world size 1: "
        "no running worker held the training state"
    )
    progress = resumed.of_kind("progress")
    assert progress[0].step == saved.step + 1 and progress[-1].step == TOTAL_STEPS
    _assert_same_parameters(tmp_path, fixed_run[0])
