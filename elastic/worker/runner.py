"""One worker's life: join the process group, build the workload, take the training state from
rank 0's checkpoint, train until the job is done or a stop is asked, save, and say how it ended
through the exit code (see elastic.worker)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.spec import JobSpec
from elastic.wire import WorkerConfig
from elastic.worker import COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import (
    TrainingState,
    broadcast_state,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from elastic.worker.data import SampleStream
from elastic.worker.events import EventWriter, ProgressReporter
from elastic.worker.settings import WorkerSettings
from elastic.worker.stop import StopRequest
from elastic.worker.trainer import SampleRecorder, Trainer
from elastic.workloads import CATALOGUE


def backend_for(device: str) -> str:
    """Return the torch.distributed backend for a WorkerConfig device: gloo for "cpu", nccl
    for "cuda:N". Raises ValueError for anything else."""
    if device == "cpu":
        return "gloo"
    if device.startswith("cuda:") and device.removeprefix("cuda:").isdigit():
        return "nccl"
    raise ValueError(f'device {device!r} is neither "cpu" nor "cuda:N"')


def init_process_group(config: WorkerConfig, timeout_s: float) -> torch.device:
    """Select the worker's device and join the job's process group; return the device.

    Raises ValueError for an unknown device and what torch.distributed raises if the group
    cannot be formed within `timeout_s`.
    """
    backend = backend_for(config.device)
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return device


class WorkerRun:
    """Trains one generation of one job as one rank; `run` returns the exit code."""

    def __init__(
        self,
        config: WorkerConfig,
        settings: WorkerSettings,
        events: EventWriter,
        stop: StopRequest,
    ) -> None:
        self.config = config
        self.settings = settings
        self.events = events
        self.stop = stop
        self.spec = JobSpec(**config.spec)
        self.workload = CATALOGUE[self.spec.workload]
        self.hyperparameters = self.workload.hyperparameters.model_validate(self.spec.hyperparameters)
        self.total_steps = self.spec.total_steps()
        self.checkpoint = checkpoint_path(config.run_dir)

    @property
    def is_leader(self) -> bool:
        return self.config.rank == 0

    def run(self) -> int:
        """Train; return COMPLETED_EXIT_CODE or STOPPED_EXIT_CODE. Raises on any failure."""
        torch.set_num_threads(self.settings.threads)
        device = init_process_group(self.config, self.settings.pg_timeout_s)
        try:
            return self._train(device)
        finally:
            dist.destroy_process_group()

    def _train(self, device: torch.device) -> int:
        problem = self.workload.build(self.hyperparameters, self.spec.seed)
        problem.model.to(device)
        problem.inputs = problem.inputs.to(device)
        problem.targets = problem.targets.to(device)
        optimizer = problem.make_optimizer()
        step = self._restore(problem.model, optimizer)
        problem.model.train()
        trainer = Trainer(
            problem,
            optimizer,
            SampleStream(len(problem.inputs), self.spec.seed),
            batch_size=self.hyperparameters.batch_size,
            seed=self.spec.seed,
            rank=self.config.rank,
            world_size=self.config.world_size,
            recorder=self._recorder(),
        )
        return self._loop(trainer, step)

    def _loop(self, trainer: Trainer, step: int) -> int:
        """Train from `step` until the job is done or a stop is agreed; save; return the code."""
        progress = ProgressReporter(
            self.events,
            total_steps=self.total_steps,
            batch_size=self.hyperparameters.batch_size,
            samples_per_epoch=self.workload.samples_per_epoch(self.hyperparameters),
            every_s=self.settings.progress_every_s,
        )
        last_save = time.monotonic()
        progress.restart_clock()
        while step < self.total_steps:
            outcome = trainer.step(step, self.stop.requested)
            step = outcome.step
            finished = step == self.total_steps
            if self.is_leader:
                progress.step_done(step, outcome.loss, outcome.samples, force=finished or outcome.stop)
            if finished:
                break
            if outcome.stop:
                self._log(f"stopping at step {step}")
                self._save_and_wait(step, trainer)
                return STOPPED_EXIT_CODE
            if self.is_leader and time.monotonic() - last_save >= self.settings.checkpoint_every_s:
                self._save(step, trainer)
                last_save = time.monotonic()
        self._log(f"completed all {self.total_steps} steps")
        self._save_and_wait(step, trainer)
        return COMPLETED_EXIT_CODE

    def _restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load rank 0's checkpoint into every rank's model and optimizer; return its step, or
        0 if there is none. Raises CheckpointError if the checkpoint is not this job's."""
        state = load_checkpoint(self.checkpoint) if self.is_leader else None
        if self.config.world_size > 1:
            state = broadcast_state(state)
        if state is None:
            self._log(f"starting from step 0 of {self.total_steps}, world size {self.config.world_size}")
            return 0
        state.check_belongs_to(self.spec.workload, self.spec.seed, self.total_steps)
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        self._log(
            f"resumed from step {state.step} of {self.total_steps}, world size {self.config.world_size}"
        )
        return state.step

    def _recorder(self) -> SampleRecorder | None:
        if self.settings.record_samples is None:
            return None
        return SampleRecorder(
            self.settings.record_samples,
            self.config.generation,
            self.config.rank,
            self.config.world_size,
        )

    def _save(self, step: int, trainer: Trainer) -> None:
        state = TrainingState(
            step=step,
            workload=self.spec.workload,
            seed=self.spec.seed,
            model=trainer.problem.model.state_dict(),
            optimizer=trainer.optimizer.state_dict(),
        )
        save_checkpoint(self.checkpoint, state)

    def _save_and_wait(self, step: int, trainer: Trainer) -> None:
        """Rank 0 saves the state after `step`; then every rank waits until it has."""
        if self.is_leader:
            self._save(step, trainer)
        dist.barrier()

    def _log(self, message: str) -> None:
        if self.is_leader:
            self.events.log(message)
