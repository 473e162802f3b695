"""The job spec and its one validation, shared by the API, the form and the worker.

`validate_spec` checks the whole spec, the workload's hyperparameters included, and reports
every bad value at once with its field, so that nothing is stored until all of it is valid.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from elastic.workloads import CATALOGUE

MAX_WORKERS_LIMIT = 1024
MAX_STEPS = 10_000_000
_VIRTUAL_WORKERS_RULE = (
    "must be at least max_workers ({w}): every worker hosts at least one virtual worker, not {v}"
)
CODE_DIGEST_PATTERN = r"^[0-9a-f]{64}$"
ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
_CODE_EPOCHS_RULE = "a job with its own code gives steps: the size of its data set is known only on the nodes"
_HYBRID_FIELDS = ("batch_per_worker", "min_batch_size", "max_batch_size")
_SHARDING_NOT_BUILT = (
    "fsdp is not available yet: the workers can shard a model with fully_shard and re-cut it in place, "
    "but a sharded job does not yet run through the platform (the worker's restore and switch, hand-over "
    "by leaving workers, checkpoints and exports); use none"
)
_SHARD_REPLICAS_NOT_BUILT = "2 is not available yet: every shard lives on one worker; use 1"
_SHARD_REPLICAS_ONLY_SHARDED = "only sharded jobs (sharding: fsdp) keep replicas of their shards"


class JobSpec(BaseModel):
    """A job: what it trains, on how many workers, for how long, and how resizes may change it.

    Rules between fields (each reported on the field a person would change):

    - give a `workload`, or `code` and `entrypoint`, never both;
    - give exactly one of `steps` and `epochs`; a job with its own code gives `steps` (the size
      of its data set is known only on the nodes), and its `hyperparameters` give `batch_size`;
    - `max_workers` is at least `min_workers`;
    - strict jobs: `virtual_workers` is at least `max_workers` and at most the global batch size;
      `batch_per_worker`, `min_batch_size` and `max_batch_size` belong to hybrid jobs only;
    - hybrid jobs have no `virtual_workers`; `max_batch_size` is at least `min_batch_size`;
    - `sharding` is none: fsdp is refused until a sharded job runs end to end; `shard_replicas`
      is 1, and above 1 only with sharding and at least as many workers.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, description="the job's name, shown on the board and in lists")
    workload: str | None = Field(None, description="a shipped task (GET /api/workloads); or give code and entrypoint")
    code: str | None = Field(
        None, pattern=CODE_DIGEST_PATTERN, description="the sha256 of the job's own code, uploaded with POST /api/code"
    )
    entrypoint: str | None = Field(
        None, max_length=200, pattern=ENTRYPOINT_PATTERN, description="the task class in the code: module:ClassName"
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="handed to the task: a workload's are checked against its schema and completed with its "
        "defaults; a job with its own code must give batch_size (the global batch)",
    )
    min_workers: int = Field(
        1, ge=1, le=MAX_WORKERS_LIMIT,
        description="the fewest workers (devices) the job trains on; below it, the job waits in the queue",
    )
    max_workers: int = Field(
        1, ge=1, le=MAX_WORKERS_LIMIT, description="the most workers the scheduler gives the job"
    )
    priority: Literal["guaranteed", "opportunistic"] = Field(
        "guaranteed",
        description="guaranteed jobs are served first from the shared devices; opportunistic ones get what "
        "they leave and the devices lent while their owners are away, and give them back when the owner returns",
    )
    consistency: Literal["strict", "hybrid"] = Field(
        "strict",
        description="strict: the model does not depend on the resizes (fixed global batch, virtual workers); "
        "hybrid: the global batch grows and shrinks with the workers",
    )
    virtual_workers: int | None = Field(
        None, ge=1, le=MAX_WORKERS_LIMIT * 16, description="strict: virtual workers (default max_workers)"
    )
    batch_per_worker: int | None = Field(
        None, ge=1, le=65536, description="hybrid: samples each worker adds to the global batch"
    )
    min_batch_size: int | None = Field(None, ge=1, le=65536, description="hybrid: smallest global batch")
    max_batch_size: int | None = Field(None, ge=1, le=65536, description="hybrid: largest global batch")
    lr_scaling: Literal["linear", "sqrt"] = Field(
        "linear", description="hybrid: how the learning rate follows the global batch (linear or square root)"
    )
    warmup_steps: int = Field(
        50, ge=0, le=1_000_000,
        description="hybrid: steps over which the learning rate moves to its new value, at the start and after "
        "every change of the global batch",
    )
    eval_every_steps: int | None = Field(
        None, ge=1, le=10_000_000,
        description="evaluate the task on its eval_data every this many steps (always at the end)",
    )
    nan_loss: Literal["fail", "skip"] = Field(
        "fail",
        description="a step whose loss is NaN or infinite on any worker: fail the job at once, or skip the "
        "step (nothing of it is applied) and go on",
    )
    init_from: int | None = Field(
        None, ge=1, le=2**31 - 1,
        description="start from the final model of this finished job of yours (its model.pt); the optimiser "
        "starts fresh",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: the task's forward and loss run under torch.autocast in bfloat16, the weights, "
        "gradients and optimiser in fp32 (strict keeps its bit-for-bit promise: each virtual worker's forward "
        "sees the same shapes wherever it runs); fp32: no autocast",
    )
    sharding: Literal["none", "fsdp"] = Field(
        "none",
        description="none: every worker holds the whole model, its gradients and its optimiser state; fsdp "
        "(not available yet): each worker holds a 1/N shard of them (torch's fully_shard)",
    )
    shard_replicas: int = Field(
        1, ge=1, le=2,
        description="sharded jobs: on how many workers each shard lives (2, not available yet: a crash loses no step)",
    )
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="global steps to train (or give epochs)")
    epochs: float | None = Field(
        None, gt=0, le=100_000,
        description="a workload only: passes over its training data, turned into steps at its batch size",
    )
    seed: int = Field(
        0, ge=0, le=2**31 - 1,
        description="seeds the initial model, the data order and every step's random streams",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_or_nul(cls, value: Any) -> Any:
        """true/false is no number (pydantic would read it as 1/0), and a NUL character has no
        place in any text of a spec (PostgreSQL cannot store it)."""
        if isinstance(value, bool):
            raise ValueError(f"{str(value).lower()} is not a valid value here")
        if _holds_nul(value):
            raise ValueError("contains a NUL character (\\u0000)")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> JobSpec:
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers})")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of steps and epochs")
        if (self.workload is None) == (self.code is None) or (self.code is None) != (self.entrypoint is None):
            raise ValueError("give a workload, or code and entrypoint")
        if self.code is not None and self.epochs is not None:
            raise ValueError(_CODE_EPOCHS_RULE)
        if self.virtual_workers is not None and self.virtual_workers < self.max_workers:
            raise ValueError(_VIRTUAL_WORKERS_RULE.format(v=self.virtual_workers, w=self.max_workers))
        if self.sharding != "none":
            raise ValueError(f"sharding: {_SHARDING_NOT_BUILT}")
        if self.shard_replicas != 1:
            raise ValueError(f"shard_replicas: {_SHARD_REPLICAS_ONLY_SHARDED}")
        return self

    def virtual_worker_count(self) -> int:
        """Strict mode's V: `virtual_workers`, or one per worker at the most workers."""
        return self.virtual_workers if self.virtual_workers is not None else self.max_workers

    def hybrid_batch_bounds(self, batch_size: int) -> tuple[int, int, int]:
        """Hybrid mode's (batch_per_worker, min_batch_size, max_batch_size), defaults filled in
        from the workload's `batch_size`, which is the global batch at max_workers and the batch
        its learning rate was tuned for: per worker batch_size // max_workers (at least 1),
        bounds from that per-worker batch at min_workers to batch_size."""
        per_worker = self.batch_per_worker or max(1, batch_size // self.max_workers)
        low = self.min_batch_size or min(batch_size, per_worker * self.min_workers)
        high = self.max_batch_size or max(batch_size, low)
        return per_worker, low, high

    @property
    def task_name(self) -> str:
        """What the job trains, for people and checkpoints: the workload, or the code's
        entrypoint and digest."""
        if self.workload is not None:
            return self.workload
        return f"{self.entrypoint} of code {str(self.code)[:12]}"

    def batch_size(self) -> int:
        """The global batch size: the workload's (its default when not given) or the one the
        job's hyperparameters give its own code."""
        if self.workload is None:
            return int(self.hyperparameters["batch_size"])
        hp = CATALOGUE[self.workload].hyperparameters.model_validate(self.hyperparameters)
        return int(hp.model_dump()["batch_size"])

    def total_steps(self) -> int:
        """Steps to train: `steps`, or `epochs` worth of global batches, rounded up (a
        workload's only: the size of a job's own data set is known only on the nodes)."""
        if self.steps is not None:
            return self.steps
        assert self.workload is not None
        info = CATALOGUE[self.workload]
        hp = info.hyperparameters.model_validate(self.hyperparameters)
        per_epoch = info.samples_per_epoch(hp)
        assert self.epochs is not None
        return max(1, math.ceil(self.epochs * per_epoch / int(hp.model_dump()["batch_size"])))


def _holds_nul(value: Any) -> bool:
    """Whether a NUL character is in `value`, its keys or anything nested in it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and "\x00" in item:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str
    value: Any = None


class SpecError(ValueError):
    """Raised by `validate_spec`; `errors` lists every bad field with what was wrong."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))


_MISSING = object()


def _value_at(data: Any, location: tuple[Any, ...]) -> Any:
    for part in location:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data


def _unknown_field(name: str, known: Collection[str]) -> str:
    """What to say of a field the model does not have: the nearest known name, if one is close
    (a typo such as max_wokers), else every known name."""
    nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if nearest:
        return f"unknown field; did you mean {nearest[0]}?"
    return f"unknown field; the fields are {', '.join(known)}"


def _errors_from(exc: ValidationError, data: Any, known: Collection[str], prefix: str = "") -> list[FieldError]:
    """The field errors of `exc`, raised validating `data` against a model whose fields are
    `known`."""
    errors = []
    for err in exc.errors():
        location = tuple(err["loc"])
        field = prefix + ".".join(str(p) for p in location) if location else prefix.rstrip(".")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and len(location) == 1:
            message = _unknown_field(str(location[0]), known)
        errors.append(FieldError(field or "spec", message, _value_at(data, location)))
    return errors


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _cross_field_errors(data: dict[str, Any]) -> list[FieldError]:
    """The rules that involve two fields, reported on the field a person would change."""
    errors = []
    low, high = _as_number(data.get("min_workers", 1)), _as_number(data.get("max_workers", 1))
    if low is not None and high is not None and high < low:
        errors.append(
            FieldError(
                "max_workers",
                f"must be at least min_workers ({data.get('min_workers', 1)})",
                data.get("max_workers"),
            )
        )
    has_steps = data.get("steps") not in (None, "")
    has_epochs = data.get("epochs") not in (None, "")
    if has_steps and has_epochs:
        errors.append(
            FieldError("epochs", "give exactly one of steps and epochs, not both", data.get("epochs"))
        )
    elif not has_steps and not has_epochs:
        errors.append(FieldError("steps", "give exactly one of steps and epochs", None))
    errors.extend(_mode_errors(data, high))
    errors.extend(_task_errors(data, has_epochs))
    errors.extend(_sharding_errors(data, high))
    return errors


def _sharding_errors(data: dict[str, Any], max_workers: float | None) -> list[FieldError]:
    """Sharding and its replicas, each refusal with its own message on its own field."""
    errors = []
    sharding = data.get("sharding")
    if sharding == "fsdp":
        errors.append(FieldError("sharding", _SHARDING_NOT_BUILT, sharding))
    replicas = data.get("shard_replicas")
    if replicas != 2 or isinstance(replicas, bool):
        return errors  # absent, 1, or out of range: the field's own check speaks
    if sharding != "fsdp":
        errors.append(FieldError("shard_replicas", _SHARD_REPLICAS_ONLY_SHARDED, replicas))
    elif max_workers is not None and max_workers < replicas:
        errors.append(FieldError(
            "shard_replicas",
            f"keeps each shard on {replicas} workers, but max_workers is {data.get('max_workers', 1)}",
            replicas,
        ))
    else:
        errors.append(FieldError("shard_replicas", _SHARD_REPLICAS_NOT_BUILT, replicas))
    return errors


def _task_errors(data: dict[str, Any], has_epochs: bool) -> list[FieldError]:
    """A job trains a shipped workload, or its own code (a digest) at an entrypoint."""
    given = {name: data.get(name) for name in ("workload", "code", "entrypoint") if data.get(name) not in (None, "")}
    if "workload" in given and "code" in given:
        return [FieldError("code", "give either a workload or code, not both", given["code"])]
    if "workload" not in given and "code" not in given:
        return [FieldError("workload", "give a workload, or code and entrypoint", None)]
    errors = []
    if "code" in given and "entrypoint" not in given:
        errors.append(FieldError("entrypoint", "a job with code names its task class: module:ClassName", None))
    if "entrypoint" in given and "code" not in given:
        errors.append(FieldError("entrypoint", "only a job with code has an entrypoint", given["entrypoint"]))
    if "code" in given and has_epochs:
        errors.append(FieldError("epochs", _CODE_EPOCHS_RULE, data.get("epochs")))
    if "code" in given:
        hyperparameters = data.get("hyperparameters", {})
        batch = hyperparameters.get("batch_size") if isinstance(hyperparameters, dict) else None
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 65536:
            errors.append(FieldError(
                "hyperparameters.batch_size", "a job with code gives its global batch size, 1 to 65536", batch
            ))
    return errors


def _mode_errors(data: dict[str, Any], max_workers: float | None) -> list[FieldError]:
    """The fields that belong to one consistency mode, checked against that mode."""
    errors = []
    hybrid = data.get("consistency") == "hybrid"
    given = {
        name: data.get(name)
        for name in ("virtual_workers", *_HYBRID_FIELDS)
        if data.get(name) not in (None, "")
    }
    if hybrid and "virtual_workers" in given:
        errors.append(
            FieldError("virtual_workers", "only strict jobs have virtual workers", given["virtual_workers"])
        )
    if not hybrid:
        errors.extend(
            FieldError(name, "only hybrid jobs take this; strict keeps the global batch fixed", given[name])
            for name in _HYBRID_FIELDS
            if name in given
        )
    virtual = _as_number(given.get("virtual_workers"))
    if virtual is not None and max_workers is not None and 1 <= virtual < max_workers:
        errors.append(
            FieldError(
                "virtual_workers",
                _VIRTUAL_WORKERS_RULE.format(v=given["virtual_workers"], w=data.get("max_workers")),
                given["virtual_workers"],
            )
        )
    low, high = _as_number(given.get("min_batch_size")), _as_number(given.get("max_batch_size"))
    if low is not None and high is not None and high < low:
        errors.append(
            FieldError(
                "max_batch_size",
                f"must be at least min_batch_size ({given['min_batch_size']})",
                given["max_batch_size"],
            )
        )
    return errors


def _with_mode_defaults(spec: JobSpec, batch_size: int) -> tuple[JobSpec, list[FieldError]]:
    """Returns `spec` with its mode's defaults written out (V for strict, the batch bounds for
    hybrid), so that the stored spec says what the job runs with, and the errors of the rules
    that involve the workload's global batch size."""
    if spec.consistency == "strict":
        virtual = spec.virtual_worker_count()
        if virtual > batch_size:
            error = FieldError(
                "virtual_workers",
                f"must be at most the global batch size ({batch_size}): each virtual worker trains at least one sample",
                virtual,
            )
            return spec, [error]
        return spec.model_copy(update={"virtual_workers": virtual}), []
    per_worker, low, high = spec.hybrid_batch_bounds(batch_size)
    if high < low and spec.min_batch_size is None:  # both given: reported with the other rules
        return spec, [FieldError("max_batch_size", f"must be at least min_batch_size ({low})", high)]
    return spec.model_copy(
        update={"batch_per_worker": per_worker, "min_batch_size": low, "max_batch_size": high}
    ), []


def validate_spec(data: Any) -> JobSpec:
    """Validate a submitted spec (a dict, as parsed from JSON or YAML).

    Returns the spec with the workload's hyperparameters completed with their defaults.
    Raises SpecError listing every invalid field, the hyperparameters' included.
    """
    if not isinstance(data, dict):
        raise SpecError([FieldError("spec", "must be an object", data)])
    errors = _cross_field_errors(data)
    spec: JobSpec | None = None
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        # Whole-spec errors repeat the cross-field ones above, which name their field.
        errors.extend(e for e in _errors_from(exc, data, list(JobSpec.model_fields)) if e.field != "spec")

    workload = data.get("workload")
    info = CATALOGUE.get(workload) if isinstance(workload, str) else None
    if isinstance(workload, str) and info is None:
        known = ", ".join(sorted(CATALOGUE))
        errors.append(FieldError("workload", f"unknown workload; choose one of: {known}", workload))
    hyperparameters = data.get("hyperparameters", {})
    if info is not None and isinstance(hyperparameters, dict):
        try:
            validated = info.hyperparameters.model_validate(hyperparameters)
        except ValidationError as exc:
            errors.extend(_errors_from(
                exc, hyperparameters, list(info.hyperparameters.model_fields), prefix="hyperparameters."
            ))
        else:
            if spec is not None:
                spec = spec.model_copy(update={"hyperparameters": validated.model_dump()})
                spec, mode_errors = _with_mode_defaults(spec, int(validated.model_dump()["batch_size"]))
                errors.extend(mode_errors)
    if spec is not None and spec.code is not None and not errors:
        # The job's own code validates its hyperparameters on the nodes (the portal never
        # imports it); its batch size is checked above.
        spec, mode_errors = _with_mode_defaults(spec, spec.batch_size())
        errors.extend(mode_errors)
    if spec is not None and spec.epochs is not None and not errors:
        steps = spec.total_steps()
        if steps > MAX_STEPS:
            errors.append(FieldError(
                "epochs", f"{spec.epochs:g} epochs are {steps:,} steps at this batch size; a job has at most "
                f"{MAX_STEPS:,} steps", spec.epochs,
            ))
    if errors:
        raise SpecError(errors)
    assert spec is not None
    return spec
