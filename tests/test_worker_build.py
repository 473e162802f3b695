"""A worker's build (elastic.worker.build): one a standby prepared for a job is taken only by a
worker of that job on that device with the same settings; strict mode's warm-up pays for its step
buffers, and a resize that leaves a worker fewer virtual workers allocates none; and a real
standby process, prepared and then assigned, hands its worker the build it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.wire import WorkerConfig
from elastic.worker import WORKER_CONFIG_ENV, build
from elastic.worker.settings import WorkerSettings
from elastic.worker.standby import PREPARED_LINE, READY_LINE, Assignment, Preparation
from elastic.worker.strict import StrictTrainer

ROOT = Path(__file__).resolve().parent.parent
SPEC: dict[str, Any] = {
    "name": "prepared",
    "workload": "digits-mlp",
    "min_workers": 1,
    "max_workers": 4,
    "steps": 10,
    "seed": 3,
    "hyperparameters": {"hidden": 16, "layers": 2, "batch_size": 16},
}


def config(**changes: Any) -> WorkerConfig:
    fields: dict[str, Any] = {
        "job_id": 7,
        "generation": 2,
        "rank": 1,
        "world_size": 2,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "device": "cpu",
        "spec": SPEC,
        "run_dir": "/tmp/bungee-build-test",
        "node": "node-a",
        "device_index": 1,
        "redis_url": "redis://127.0.0.1:6379/13",
        "coordination_key": "bungee-build-test:job:7",
    }
    return WorkerConfig(**{**fields, **changes})


@pytest.fixture(autouse=True)
def nothing_held() -> Iterator[None]:
    build.discard()
    yield
    build.discard()


def test_a_prepared_build_goes_to_a_worker_of_its_job_on_its_device_in_any_rank() -> None:
    settings = WorkerSettings()
    made = build.prepare(config(), settings)
    assert made.prepared
    # Rank, world size and generation are provisional: the trainer takes them on as it enters.
    taken = build.take(config(rank=2, world_size=3, generation=5), settings)
    assert taken is made
    assert build.take(config(), settings) is None, "a build is taken once"


@pytest.mark.parametrize(
    "other",
    [
        {"job_id": 8},
        {"device_index": 2},
        {"spec": {**SPEC, "seed": 4}},
        {"code_dir": "/srv/code", "entrypoint": "task:Task"},
    ],
)
def test_a_worker_of_anything_else_builds_its_own(other: dict[str, Any]) -> None:
    build.prepare(config(), WorkerSettings())
    assert build.take(config(**other), WorkerSettings()) is None
    assert build.take(config(), WorkerSettings()) is None, "what did not match is discarded"


def test_other_settings_build_their_own() -> None:
    build.prepare(config(), WorkerSettings())
    assert build.take(config(), WorkerSettings(bucket_mb=0)) is None


def test_strict_warm_up_touches_the_step_buffers_and_a_smaller_share_reuses_them() -> None:
    made = build.build(config(rank=0, world_size=1), WorkerSettings())
    trainer = made.trainer
    assert isinstance(trainer, StrictTrainer)
    terms, _ = trainer._step_buffers()
    assert terms.shape[0] == 4  # every vw of 4, at one worker
    assert trainer._buffer is None, "strict mode has no use for the plain mode's gradient buffer"
    storage = terms.untyped_storage().data_ptr()
    trainer.rebind(0, 2)  # a scale-out: this worker now hosts 2 vws
    fewer, _ = trainer._step_buffers()
    assert fewer.shape[0] == 2 and fewer.untyped_storage().data_ptr() == storage
    assert torch.count_nonzero(fewer) == 0


def test_a_prepared_standby_process_hands_its_worker_the_build(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        WORKER_CONFIG_ENV: config().model_dump_json(),
    }
    standby = subprocess.Popen(
        [sys.executable, "-m", "elastic.worker.standby", "--module", "tests.standby_build_probe"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    assert standby.stdin is not None and standby.stdout is not None
    try:
        assert READY_LINE in standby.stdout.readline().decode()
        standby.stdin.write(Preparation(env=env).model_dump_json().encode() + b"\n")
        standby.stdin.flush()
        said = json.loads(standby.stdout.readline())
        assert said["standby"] == PREPARED_LINE and said["job"] == 7, said
        output = tmp_path / "worker.out"
        worker_env = {**env, WORKER_CONFIG_ENV: config(rank=3, world_size=4).model_dump_json(), "PROBE_SECRET": "s"}
        standby.stdin.write(Assignment(output=str(output), env=worker_env).model_dump_json().encode() + b"\n")
        standby.stdin.close()
        assert standby.wait(timeout=60) == 0
    finally:
        standby.kill()
        standby.wait()
    found = json.loads(output.read_text().strip().splitlines()[-1])
    # 64 inputs -> 16 -> 16 -> 10 outputs: the digits MLP of two layers.
    assert found == {"prepared": True, "rank": 3, "parameters": 64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10, "secret": "s"}


def test_a_standby_is_prepared_once() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", WORKER_CONFIG_ENV: config().model_dump_json()}
    line = Preparation(env=env).model_dump_json().encode() + b"\n"
    done = subprocess.run(
        [sys.executable, "-m", "elastic.worker.standby", "--module", "tests.standby_build_probe"],
        env=env,
        input=line + line,
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0
    assert b"prepared twice" in done.stderr


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_a_bf16_job_runs_its_loss_under_autocast_and_trains(precision: str, dtype: torch.dtype, group_of_one: None) -> None:
    spec = {**SPEC, "consistency": "hybrid", "max_workers": 1, "batch_per_worker": 16, "min_batch_size": 16,
            "max_batch_size": 16, "warmup_steps": 0, "precision": precision}  # fmt: skip
    made = build.build(config(spec=spec, rank=0, world_size=1), WorkerSettings())
    task = made.problem.task
    seen: list[torch.dtype] = []
    own_loss = task.loss

    def loss(model: torch.nn.Module, batch: Any) -> Any:
        seen.append((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)  # a matmul inside the task's loss
        return own_loss(model, batch)

    task.loss = loss
    before = [p.detach().clone() for p in made.problem.model.parameters()]
    made.trainer.rebind_members(0, 1, None, 0)
    outcomes = [made.trainer.step(step, False) for step in range(3)]
    assert seen == [dtype] * 3
    assert all(outcome.loss == outcome.loss and not outcome.skipped for outcome in outcomes)
    assert any(not torch.equal(a, b) for a, b in zip(before, made.problem.model.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in made.problem.model.parameters()), "autocast leaves the weights fp32"


SCHEDULED_TASK = '''
from types import SimpleNamespace

import torch


class Scheduled:
    def __init__(self, hyperparameters):
        self.hp = hyperparameters

    def model(self):
        return torch.nn.Linear(2, 1)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.5)

    def scheduler(self, optimizer):
        # Down to nothing at the job's last step, whatever steps the spec gives.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / self.job.steps)

    def train_data(self):
        generator = torch.Generator().manual_seed(self.job.seed)
        return torch.utils.data.TensorDataset(torch.randn(32, 2, generator=generator), torch.randn(32, 1))

    def loss(self, model, batch):
        points, targets = batch
        return torch.nn.functional.mse_loss(model(points), targets)


class OwnJob(Scheduled):
    def __init__(self, hyperparameters):
        super().__init__(hyperparameters)
        self.job = SimpleNamespace(steps=100, seed=1, mine=True)
'''


def test_a_task_learns_its_jobs_steps_and_seed_and_its_schedule_ends_with_the_job(
    tmp_path: Path, group_of_one: None
) -> None:
    (tmp_path / "task.py").write_text(SCHEDULED_TASK)
    spec = {
        "name": "scheduled", "code": "0" * 64, "entrypoint": "task:Scheduled", "steps": 4, "seed": 9,
        "hyperparameters": {"batch_size": 8},
    }
    own_code = {"rank": 0, "world_size": 1, "code_dir": str(tmp_path), "entrypoint": "task:Scheduled", "spec": spec}
    made = build.build(config(**own_code), WorkerSettings())
    assert made.problem.task.job.steps == 4 and made.problem.task.job.seed == 9
    rates = []
    for step in range(4):
        made.trainer.step(step, False)
        rates.append(made.trainer.lr)
    assert rates == pytest.approx([0.5, 0.375, 0.25, 0.125]), "the rate falls over the job's 4 steps"
    older = build.build(config(**{**own_code, "entrypoint": "task:OwnJob"}), WorkerSettings())
    assert older.problem.task.job.mine, "a task that has a job of its own keeps it"
