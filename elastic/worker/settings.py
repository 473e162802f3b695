"""The worker's tunables (WorkerSettings), read from the environment it inherits from its agent,
once at start. Every one has a default that suits a laptop; a value that does not parse stops
the worker with the variable and the value quoted (WorkerSettingsError)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from elastic.environ_settings import EnvironSettings, SettingsError

BUCKET_BYTES = 25 * 2**20
"""The default size of the gradient's buckets, overlapped with backward (DDP's default), so that
the first ones travel while backward computes the rest."""


class WorkerSettingsError(SettingsError):
    """An environment variable holds a value the worker cannot use."""


class WorkerSettings(EnvironSettings):
    """The worker's settings; `WorkerSettings.from_env(os.environ)` reads them."""

    threads: int = Field(1, ge=1, validation_alias="OMP_NUM_THREADS", description="Intra-op threads of torch.")
    pg_timeout_s: float = Field(
        30.0,
        gt=0,
        validation_alias="BUNGEE_PG_TIMEOUT_S",
        description="How long a collective waits for the other ranks before the step fails (a peer that hangs "
        "rather than dies), and how long members with no running group wait for each other.",
    )
    rendezvous_timeout_s: float = Field(
        10.0,
        gt=0,
        validation_alias="BUNGEE_RENDEZVOUS_TIMEOUT_S",
        description="How long forming a new generation's group at a switch may take; its members all arrive "
        "within a step of each other, so anything longer means one of them is gone.",
    )
    membership_poll_s: float = Field(
        0.05,
        gt=0,
        validation_alias="BUNGEE_MEMBERSHIP_POLL_S",
        description="How often rank 0 reads the membership board (from a thread beside the training loop).",
    )
    checkpoint_every_s: float = Field(
        30.0,
        gt=0,
        validation_alias="BUNGEE_CHECKPOINT_EVERY_S",
        description="Rank 0 saves a checkpoint at the first step boundary after this many seconds.",
    )
    progress_every_s: float = Field(
        0.5,
        gt=0,
        validation_alias="BUNGEE_PROGRESS_EVERY_S",
        description="Rank 0 reports progress at most this often (plus the first and the last step).",
    )
    record_samples: Path | None = Field(
        None,
        validation_alias="BUNGEE_RECORD_SAMPLES",
        description="If set, every rank appends the sample indices of each step it completes to this file, one "
        "JSON object a line; for tests of the data order.",
    )
    simulated_slowdown: float = Field(
        1.0,
        ge=1,
        validation_alias="BUNGEE_SIM_SLOWDOWN",
        description="Set by the simulated device backend on a device that plays a slow one: each step's compute "
        "is stretched by this factor (elastic.worker.step_clock).",
    )
    simulated_pace: float = Field(
        1.0,
        ge=1,
        le=100,
        validation_alias="BUNGEE_SIM_STEP_PACE",
        description="Set by the simulated device backend of an agent with a pace (--sim-pace): after each step "
        "the worker sleeps this factor less one times the CPU time the step took, so that it keeps at most "
        "1/pace of a core busy (elastic.worker.step_clock).",
    )
    shared_gpu: bool = Field(
        False,
        validation_alias="BUNGEE_SHARED_GPU",
        description="1: several workers of a job share one GPU (a machine with a single GPU, for tests and "
        "benchmarks). NCCL refuses two ranks on one GPU, so the group runs on gloo, which reduces and "
        "broadcasts CUDA tensors through host memory; state transfers are staged through it.",
    )
    bucket_mb: float = Field(
        BUCKET_BYTES / 2**20,
        ge=0,
        le=4096,
        validation_alias="BUNGEE_BUCKET_MB",
        description="The gradient's all-reduce goes in buckets of this many MiB, overlapped with backward "
        "(elastic.worker.trainer.GradientBuckets); 0: one all-reduce after the whole backward.",
    )
    state_route: Literal["auto", "relay", "direct"] = Field(
        "auto",
        validation_alias="BUNGEE_STATE_ROUTE",
        description='How the state reaches several joiners (elastic.worker.transfer): "relay" down a chain of '
        'them, "direct" from the sources to each, or "auto": relay when the group spans several nodes, '
        "direct when it is on one (elastic.worker.restore.relayed).",
    )

    @field_validator("shared_gpu", mode="before")
    @classmethod
    def _zero_or_one(cls, value: object) -> object:
        # The agent sets it to 0 or 1; anything else is a typo, not a wish.
        if isinstance(value, str) and value not in ("0", "1"):
            raise ValueError("must be 0 or 1")
        return value

    @property
    def bucket_bytes(self) -> int:
        """The gradient buckets' size in bytes (0: one all-reduce after the whole backward)."""
        return round(self.bucket_mb * 2**20)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """Return the settings given by `env`. Raises WorkerSettingsError on a bad value."""
        try:
            return cls.from_environ(env)
        except SettingsError as err:
            raise WorkerSettingsError(str(err), err.error) from None
