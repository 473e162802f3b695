"""A worker module for tests (`python -m tests.standby_build_probe`): what a worker born from a
standby finds of the build its standby prepared (elastic.worker.build.take), printed as one JSON
line, instead of training."""

from __future__ import annotations

import json
import os

from elastic.wire import WorkerConfig
from elastic.worker import WORKER_CONFIG_ENV, build
from elastic.worker.settings import WorkerSettings


def main() -> None:
    config = WorkerConfig.model_validate_json(os.environ[WORKER_CONFIG_ENV])
    made = build.take(config, WorkerSettings.from_env(os.environ))
    found = {
        "prepared": made is not None and made.prepared,
        "rank": config.rank,
        "parameters": sum(p.numel() for p in made.problem.model.parameters()) if made is not None else 0,
        "secret": os.environ.get("PROBE_SECRET"),
    }
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
