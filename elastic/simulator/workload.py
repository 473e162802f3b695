"""Workload files: one job a row, `name,time,application,num_replicas,batch_size` (the Pollux
artifact's format, which its 1.0x, 2.0x and realistic variants share)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from elastic.simulator.traces import TraceError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@dataclass(frozen=True)
class TraceJob:
    name: str
    submitted_at: float
    application: str
    replicas: int
    """What the user asked for: the gang of the static policies, the start of the others."""
    batch_size: int


def read_workload(path: Path) -> list[TraceJob]:
    """The jobs of one workload file, in submission order. Raises TraceError on a missing file,
    a missing column or a bad value (quoting it)."""
    if not path.is_file():
        raise TraceError(f"no workload file {str(path)!r}")
    jobs = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{str(path)!r} lacks columns {missing}")
        for line, row in enumerate(reader, start=2):
            try:
                job = TraceJob(
                    row["name"],
                    float(row["time"]),
                    row["application"],
                    int(row["num_replicas"]),
                    int(row["batch_size"]),
                )
            except ValueError as error:
                raise TraceError(f"{str(path)!r} line {line}: {error}") from None
            if job.replicas < 1 or job.batch_size < 1 or job.submitted_at < 0:
                raise TraceError(f"{str(path)!r} line {line}: bad values {row}")
            jobs.append(job)
    return sorted(jobs, key=lambda j: (j.submitted_at, j.name))
