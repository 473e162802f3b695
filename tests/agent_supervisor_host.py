"""A process that holds a WorkerSupervisor, for the re-adoption tests: it launches one fake worker
(tests/agent_fake_worker.py) on simulated slot 0 with the spec given as JSON, then plays an agent
that delivers every event at once: it drains the events, prints each as a JSON line and says they
were delivered, until it is killed.

    python -m tests.agent_supervisor_host STATE_DIR SPEC_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from agent.devices.simulated import SimulatedBackend
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import LaunchCommand, WorkerAssignment

REDIS_URL = "redis://127.0.0.1:6379/13"


def main(state_dir: str, spec: str) -> None:
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module="tests.agent_fake_worker", state_dir=Path(state_dir))
    )
    command = LaunchCommand(
        job_id=7,
        generation=3,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=[WorkerAssignment(rank=0, device_index=0)],
        members=[0],
        spec=json.loads(spec),
        run_dir="/tmp/bungee-agent-test",
        coordination_key="bungee-agent-test:job:7",
        redis_url=REDIS_URL,
    )
    supervisor.launch(command, SimulatedBackend(slots=1), REDIS_URL)
    while True:
        for event in supervisor.drain_events():
            print(event.model_dump_json(), flush=True)
        supervisor.events_delivered()
        time.sleep(0.02)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
