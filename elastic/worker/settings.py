"""The worker's tunables, read from the environment once at start. Every one has a default that
suits a laptop; a value that does not parse stops the worker with the bad value quoted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "OMP_NUM_THREADS"
PG_TIMEOUT_ENV = "BUNGEE_PG_TIMEOUT_S"
RENDEZVOUS_TIMEOUT_ENV = "BUNGEE_RENDEZVOUS_TIMEOUT_S"
MEMBERSHIP_POLL_ENV = "BUNGEE_MEMBERSHIP_POLL_S"
CHECKPOINT_EVERY_ENV = "BUNGEE_CHECKPOINT_EVERY_S"
PROGRESS_EVERY_ENV = "BUNGEE_PROGRESS_EVERY_S"
RECORD_SAMPLES_ENV = "BUNGEE_RECORD_SAMPLES"
SIM_SLOWDOWN_ENV = "BUNGEE_SIM_SLOWDOWN"
SHARED_GPU_ENV = "BUNGEE_SHARED_GPU"
BUCKET_BYTES = 25 * 2**20
"""The default size of the gradient's buckets, overlapped with backward (DDP's default), so that
the first ones travel while backward computes the rest."""
STATE_ROUTE_ENV = "BUNGEE_STATE_ROUTE"
BUCKET_MB_ENV = "BUNGEE_BUCKET_MB"
STATE_ROUTES = ("auto", "relay", "direct")


class WorkerSettingsError(ValueError):
    """An environment variable holds a value the worker cannot use."""


def _float(env: Mapping[str, str], name: str) -> float | None:
    """The number in `name`, None if unset or empty. Raises WorkerSettingsError."""
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise WorkerSettingsError(f"{name}={raw!r} is not a number") from None


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name)
    if value is None:
        return default
    if not value > 0:
        raise WorkerSettingsError(f"{name}={env[name]!r} must be above 0")
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise WorkerSettingsError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise WorkerSettingsError(f"{name}={raw!r} must be at least 1")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    if raw not in ("", "0", "1"):
        raise WorkerSettingsError(f"{name}={raw!r} must be 0 or 1")
    return raw == "1"


def _state_route(env: Mapping[str, str]) -> str:
    raw = env.get(STATE_ROUTE_ENV) or "auto"
    if raw not in STATE_ROUTES:
        raise WorkerSettingsError(f"{STATE_ROUTE_ENV}={raw!r} must be one of {', '.join(STATE_ROUTES)}")
    return raw


def _bucket_bytes(env: Mapping[str, str], default: int) -> int:
    value = _float(env, BUCKET_MB_ENV)
    if value is None:
        return default
    if not 0 <= value <= 4096:
        raise WorkerSettingsError(f"{BUCKET_MB_ENV}={env[BUCKET_MB_ENV]!r} must be from 0 to 4096")
    return round(value * 2**20)


def _slowdown(env: Mapping[str, str]) -> float:
    value = _positive_float(env, SIM_SLOWDOWN_ENV, 1.0)
    if value < 1.0:
        raise WorkerSettingsError(f"{SIM_SLOWDOWN_ENV}={env[SIM_SLOWDOWN_ENV]!r} must be at least 1")
    return value


@dataclass(frozen=True)
class WorkerSettings:
    threads: int = 1
    """Intra-op threads of torch (OMP_NUM_THREADS)."""
    pg_timeout_s: float = 30.0
    """How long a collective waits for the other ranks before the step fails (a peer that hangs
    rather than dies), and how long members with no running group wait for each other."""
    checkpoint_every_s: float = 30.0
    """Rank 0 saves a checkpoint at the first step boundary after this many seconds."""
    progress_every_s: float = 0.5
    """Rank 0 reports progress at most this often (plus the first and the last step)."""
    record_samples: Path | None = None
    """If set, every rank appends the sample indices of each step it completes to this file,
    one JSON object a line; for tests of the data order."""
    rendezvous_timeout_s: float = 10.0
    """How long forming a new generation's group at a switch may take; its members all arrive
    within a step of each other, so anything longer means one of them is gone."""
    membership_poll_s: float = 0.05
    """How often rank 0 reads the membership board (from a thread beside the training loop)."""
    simulated_slowdown: float = 1.0
    """Set by the simulated device backend on a device that plays a slow one: each step's
    compute is stretched by this factor (elastic.worker.step_clock)."""
    shared_gpu: bool = False
    """Several workers of a job share one GPU (a machine with a single GPU, for tests and
    benchmarks). NCCL refuses two ranks on one GPU, so the group runs on gloo, which reduces
    and broadcasts CUDA tensors through host memory; state transfers are staged through it."""
    bucket_bytes: int = BUCKET_BYTES
    """The gradient's all-reduce goes in buckets of this size, overlapped with backward
    (elastic.worker.trainer.GradientBuckets); 0: one all-reduce after the whole backward."""
    state_route: str = "auto"
    """How the state reaches several joiners (elastic.worker.transfer): "relay" down a chain of
    them, "direct" from the sources to each, or "auto": relay when the group spans several
    nodes, direct when it is on one (elastic.worker.restore.relayed)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """Return the settings given by `env`. Raises WorkerSettingsError on a bad value."""
        record = env.get(RECORD_SAMPLES_ENV)
        return cls(
            threads=_positive_int(env, THREADS_ENV, cls.threads),
            pg_timeout_s=_positive_float(env, PG_TIMEOUT_ENV, cls.pg_timeout_s),
            rendezvous_timeout_s=_positive_float(env, RENDEZVOUS_TIMEOUT_ENV, cls.rendezvous_timeout_s),
            membership_poll_s=_positive_float(env, MEMBERSHIP_POLL_ENV, cls.membership_poll_s),
            checkpoint_every_s=_positive_float(env, CHECKPOINT_EVERY_ENV, cls.checkpoint_every_s),
            progress_every_s=_positive_float(env, PROGRESS_EVERY_ENV, cls.progress_every_s),
            record_samples=Path(record) if record else None,
            simulated_slowdown=_slowdown(env),
            shared_gpu=_flag(env, SHARED_GPU_ENV),
            bucket_bytes=_bucket_bytes(env, cls.bucket_bytes),
            state_route=_state_route(env),
        )
