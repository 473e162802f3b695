"""The names of what a job leaves its owner (written by elastic.worker.artifacts, uploaded by
the agent, kept by the portal), and the schema of its manifest, which the portal checks before
it keeps one. No torch here: the portal and the agent import it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints

from elastic.wire import OwnPackages

ARTIFACTS_DIR = "artifacts"
"""Under the job's run directory on rank 0's node."""
MODEL_NAME = "model.pt"
CHECKPOINT_NAME = "checkpoint.pt"
MANIFEST_NAME = "manifest.json"
ARTIFACT_NAMES = (MODEL_NAME, CHECKPOINT_NAME, MANIFEST_NAME)


def artifacts_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / ARTIFACTS_DIR


def run_dir_name(job_id: int, stamp: str) -> str:
    """The name of job `job_id`'s run directory (the portal's choice, under its runs directory);
    `stamp` tells apart jobs of a database that started over."""
    return f"job-{job_id}-{stamp}"


def is_artifacts_dir_of(directory: Path, job_id: int) -> bool:
    """Whether `directory` is the artifacts directory of a run directory of job `job_id` (by its
    name: a job's code names the directory, and may name another job's)."""
    return directory.name == ARTIFACTS_DIR and directory.parent.name.startswith(run_dir_name(job_id, ""))


SHORT_TEXT_CHARS = 200
"""The longest text a manifest may hold in a field the portal shows (a version, how the job ended,
a metric's name)."""
MANIFEST_MAX_BYTES = 1 << 20
"""The largest manifest the portal reads."""

ShortText = Annotated[str, StringConstraints(max_length=SHORT_TEXT_CHARS)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[StrictInt, Field(ge=0)]


class FinalResult(BaseModel):
    """The last step's loss and the task's evaluation metrics (finite numbers only)."""

    model_config = ConfigDict(allow_inf_nan=False)

    loss: float | None = None
    metrics: dict[ShortText, float] = Field(default_factory=dict, max_length=1000)
    evaluated_with_batch_size: Count | None = None


class Files(BaseModel):
    """The sha256 of each file beside the manifest."""

    model_config = ConfigDict(populate_by_name=True)

    model: Sha256 = Field(alias=MODEL_NAME)
    checkpoint: Sha256 = Field(alias=CHECKPOINT_NAME)


class TrainedWith(BaseModel):
    """What the job was trained with on rank 0's node: its Python and torch build, and its own
    packages (None: it had none, and ran in the node's packages alone)."""

    model_config = ConfigDict(extra="forbid")

    python: ShortText
    torch: ShortText
    torch_cuda: ShortText | None = None
    """The CUDA version torch was built for; None: a CPU build."""
    own_packages: OwnPackages | None = None


class Manifest(BaseModel):
    """What a job's manifest.json holds (elastic.worker.artifacts writes it; the agent uploads it;
    the portal checks it against this before it keeps it and shows it). Other keys (the spec, the
    task, torch's version) are kept as sent, bounded by the manifest's size."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    job_id: Annotated[StrictInt, Field(ge=1)]
    ended: ShortText
    step: Count
    files: Files
    final: FinalResult | None = None
    total_steps: Count | None = None
    world_size: Count | None = None
    bungee_version: ShortText | None = None
    torch_version: ShortText | None = None
    created_at: float | None = None
    environment: TrainedWith | None = None
    """Absent from the manifests of jobs that ended before it was recorded."""

    def stored(self) -> dict[str, Any]:
        """The manifest as JSON, with the files under their own names."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)
