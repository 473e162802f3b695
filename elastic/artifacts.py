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
