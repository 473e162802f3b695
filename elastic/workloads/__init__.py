"""The workload catalogue: real training problems that need no download. Importing this
package does not import torch; each workload's `builder` does, inside the worker."""

from __future__ import annotations

from elastic.workloads.api import BaseHyperparameters, TrainingProblem, WorkloadInfo
from elastic.workloads.catalogue import CATALOGUE

__all__ = ["CATALOGUE", "BaseHyperparameters", "TrainingProblem", "WorkloadInfo"]
