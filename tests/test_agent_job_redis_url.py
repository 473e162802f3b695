"""An agent starts a job's workers with the Redis URL their launch carries (the job's own Redis
user, portal.redis_users), never with its own, whose user reads the node's commands: a worker
that reads its configuration finds no credential that commands the agent."""

from __future__ import annotations

import json
import time
from pathlib import Path

from agent.commands import CommandDispatcher
from agent.devices.simulated import SimulatedBackend
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import LaunchCommand, WorkerAssignment, WorkerConfig

JOB_URL = "redis://bungee%3Ajob%3A4:job-password@127.0.0.1:6379/15"


def test_workers_get_the_launchs_redis_url(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module="tests.agent_fake_worker", stop_grace_s=5))
    dispatcher = CommandDispatcher(supervisor, SimulatedBackend(slots=1))
    try:
        dispatcher.dispatch(LaunchCommand(
            job_id=4, generation=1, world_size=1, master_addr="127.0.0.1", master_port=29500,
            workers=[WorkerAssignment(rank=0, device_index=0)], members=[0],
            spec={"config_out": str(configs)}, run_dir=str(tmp_path), coordination_key="bungee:job:4",
            redis_url=JOB_URL,
        ))
        deadline = time.monotonic() + 20
        while not any(configs.iterdir()):
            assert time.monotonic() < deadline, "the worker never wrote its configuration"
            time.sleep(0.05)
    finally:
        supervisor.shutdown()
    [written] = list(configs.iterdir())
    assert WorkerConfig.model_validate(json.loads(written.read_text())).redis_url == JOB_URL
