"""The names of what a job leaves its owner (written by elastic.worker.artifacts, uploaded by
the agent, kept by the portal). No torch here: the portal and the agent import it."""

from __future__ import annotations

from pathlib import Path

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
