"""The workload catalogue: the tasks Bungee ships (`examples/`), by name. Importing this package
does not import torch; a worker imports the task itself (elastic.tasks)."""

from __future__ import annotations

from elastic.workloads.api import WorkloadInfo
from elastic.workloads.catalogue import CATALOGUE

__all__ = ["CATALOGUE", "WorkloadInfo"]
