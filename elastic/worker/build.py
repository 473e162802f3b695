"""A worker's build: the job's task code, its model and data, the optimiser, the trainer of its
consistency mode and one warm-up pass, on the worker's device. A worker makes it as it starts
(elastic.worker.runner). A standby prepared for a job makes it before any worker is asked for
(elastic.worker.standby), and the worker that standby becomes takes it: the build, seconds of a
joiner's start-up on a busy node, is then off the resize's path.

A build depends on the job (its id, spec, code, initial model and run directory), the device
and the worker's settings; never on the rank, the world size or the generation, which the trainer
takes on when its worker enters a generation (Trainer.rebind_members), as a survivor's does at
every switch. A prepared build is taken only by a worker whose config and settings give the
same build (`take`); any other finds none and builds its own. A process holds one build at most,
and a standby that prepared one for a job is handed that job's worker or killed: the job's
modules never reach another job's worker.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from elastic.spec import JobSpec
from elastic.tasks.api import TaskDefinitionError
from elastic.tasks.loader import load_task_class
from elastic.tasks.runtime import BoundTask
from elastic.wire import WorkerConfig
from elastic.worker.data import SampleStream, share_bounds
from elastic.worker.hybrid import HybridSchedule, HybridTrainer
from elastic.worker.settings import WorkerSettings
from elastic.worker.strict import StrictTrainer
from elastic.worker.trainer import Trainer
from elastic.worker.transfer import touched_like
from elastic.workloads import CATALOGUE

BUILD_FIELDS = frozenset(
    {"job_id", "spec", "run_dir", "device", "device_index", "node", "code_dir", "entrypoint", "initial_model"}
)
"""The fields of a WorkerConfig a build depends on: two configs that agree on them (and the same
settings) give the same build."""


def deterministic_cuda() -> None:
    """Makes this process's CUDA kernels deterministic, as strict mode's bitwise promise needs:
    cuDNN's autotuner and its atomic-accumulating backward convolutions, cuBLAS's split-K
    workspaces and scatter-adds otherwise vary from run to run. Call before the first kernel."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def set_up_device(spec: JobSpec, settings: WorkerSettings, device: torch.device) -> None:
    """What this process does before its first tensor: torch's threads, and on a GPU the device
    (made current) and deterministic kernels for strict mode, cuDNN's autotuner otherwise."""
    torch.set_num_threads(settings.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec.consistency == "strict":
            deterministic_cuda()
        else:  # cuDNN's autotuner, as a user's own loop sets it: the fastest kernels per shape
            torch.backends.cudnn.benchmark = True


@dataclass
class Build:
    """One job's build on one device (see the module docstring)."""

    config: dict[str, Any]
    """The BUILD_FIELDS of the config it was made for."""
    settings: WorkerSettings
    source: tuple[Path, str]
    """The task's directory and entrypoint."""
    problem: BoundTask
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    trainer: Trainer
    seconds: dict[str, float]
    """How long each part took: code, model, optimiser, warm_up."""
    prepared: bool = False
    """Made by a standby before its worker was asked for."""
    touched: list[torch.Tensor | None] = field(default_factory=list)
    """Memory for the optimiser state, should this worker receive it at its first switch
    (elastic.worker.transfer.touched_like); the switch uses it up or drops it."""

    def describe(self) -> str:
        s = self.seconds
        return (
            f"the task's code {s['code']:.2f} s, the model and data {s['model']:.2f} s, the optimiser and "
            f"trainer {s['optimiser']:.2f} s, a warm-up pass and the optimiser state's memory {s['warm_up']:.2f} s"
        )


def task_source(config: WorkerConfig, spec: JobSpec) -> tuple[Path, str]:
    """The directory and entrypoint of the job's task: its own code, as the agent unpacked it, or
    the shipped task of its workload. Raises TaskDefinitionError."""
    if config.code_dir is not None and config.entrypoint is not None:
        return Path(config.code_dir), config.entrypoint
    if spec.workload is None:
        raise TaskDefinitionError("the job names code of its own, but the agent gave this worker none")
    info = CATALOGUE[spec.workload]
    return info.path, info.entrypoint


def task_class(config: WorkerConfig, spec: JobSpec) -> tuple[type, tuple[Path, str]]:
    """The job's task class (task_source), with its directory and entrypoint. Raises
    TaskDefinitionError."""
    source = task_source(config, spec)
    return load_task_class(*source), source


def make_trainer(
    spec: JobSpec,
    config: WorkerConfig,
    settings: WorkerSettings,
    problem: BoundTask,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
) -> Trainer:
    """The trainer of the job's consistency mode (elastic.worker.strict, .hybrid), as rank
    `config.rank` of `config.world_size` until its worker enters a generation. Its sample
    recorder and step clock are the worker's to attach."""
    stream = SampleStream(problem.num_samples, spec.seed)
    batch_size = problem.batch_size
    if spec.consistency == "strict":
        return StrictTrainer(
            problem,
            optimizer,
            stream,
            batch_size=batch_size,
            seed=spec.seed,
            rank=config.rank,
            world_size=config.world_size,
            virtual_workers=spec.virtual_worker_count(),
            scheduler=scheduler,
            skip_nonfinite=spec.nan_loss == "skip",
        )
    per_worker, low, high = spec.hybrid_batch_bounds(batch_size)
    schedule = HybridSchedule(
        base_lr=problem.lr,
        base_batch=batch_size,
        batch_per_worker=per_worker,
        min_batch=low,
        max_batch=high,
        lr_scaling=spec.lr_scaling,
        warmup_steps=spec.warmup_steps,
    )
    return HybridTrainer(
        problem,
        optimizer,
        stream,
        schedule,
        seed=spec.seed,
        rank=config.rank,
        world_size=config.world_size,
        scheduler=scheduler,
        skip_nonfinite=spec.nan_loss == "skip",
        bucket_bytes=settings.bucket_bytes,
    )


def build(config: WorkerConfig, settings: WorkerSettings) -> Build:
    """Builds the job of `config` on its device, ending with a warm-up pass on the share of a
    batch that `config.rank` of `config.world_size` trains. Raises TaskDefinitionError or
    UserCodeError if the job's code fails. The device must be set up (set_up_device)."""
    spec = JobSpec(**config.spec)
    device = torch.device(config.device)
    began = time.monotonic()
    cls, source = task_class(config, spec)
    loaded = time.monotonic()
    problem = BoundTask(
        cls, spec.hyperparameters, spec.seed, device, source, precision=spec.precision, steps=spec.total_steps()
    )
    try:
        if config.initial_model is not None:
            problem.load_initial_model(Path(config.initial_model), f"job {spec.init_from}")
        built = time.monotonic()
        optimizer = problem.make_optimizer()
        scheduler = problem.make_scheduler(optimizer)
        trainer = make_trainer(spec, config, settings, problem, optimizer, scheduler)
        start, stop = share_bounds(problem.batch_size, config.world_size, config.rank)
        optimised = time.monotonic()
        trainer.warm_up(stop - start)
        touched = touched_like(optimizer, device)
    except BaseException:
        problem.close()
        raise
    warm = time.monotonic()
    return Build(
        config=config.model_dump(include=set(BUILD_FIELDS)),
        settings=settings,
        source=source,
        problem=problem,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer=trainer,
        seconds={"code": loaded - began, "model": built - loaded, "optimiser": optimised - built, "warm_up": warm - optimised},
        touched=touched,
    )


_held: Build | None = None
"""The build this process prepared and no worker has taken yet."""


def prepare(config: WorkerConfig, settings: WorkerSettings) -> Build:
    """Builds the job of `config` (a standby prepared for it) and holds the build for the worker
    this process becomes (`take`). Raises as `build` does; nothing is held then."""
    global _held
    discard()
    set_up_device(JobSpec(**config.spec), settings, torch.device(config.device))
    made = build(config, settings)
    made.prepared = True
    _held = made
    return made


def take(config: WorkerConfig, settings: WorkerSettings) -> Build | None:
    """The build this process prepared, if it is the one `config` and `settings` give; else
    None (a build held for anything else is discarded)."""
    global _held
    held, _held = _held, None
    if held is None:
        return None
    if held.config == config.model_dump(include=set(BUILD_FIELDS)) and held.settings == settings:
        return held
    held.problem.close()
    return None


def discard() -> None:
    """Drops the build this process holds, if any."""
    global _held
    if _held is not None:
        _held.problem.close()
        _held = None
