"""A node that has just arrived warms up before it registers: the real agent (agent.main.Agent)
with a real supervisor starts its fork server's imports (and so its standbys) before its first
registration is answered, so that the worker the portal asks for as soon as the node is known
finds them under way. The portal client here answers "unavailable" and records what the node had
started by then."""

from __future__ import annotations

import threading
from pathlib import Path

from agent.client import PortalUnavailableError
from agent.devices.simulated import SimulatedBackend
from agent.main import Agent, ExitCode
from agent.settings import AgentConfig
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import NodeRegistration
from tests.test_agent_supervisor import FAKE_WORKER, REDIS_URL


class UnavailablePortal:
    """A portal not answering yet; on the first registration it notes whether the node's fork
    server was importing, and tells the agent to stop."""

    base_url = "http://portal.invalid"

    def __init__(self, supervisor: WorkerSupervisor, stopping: threading.Event) -> None:
        self.supervisor = supervisor
        self.stopping = stopping
        self.importing_at_registration: bool | None = None

    def register(self, registration: NodeRegistration) -> None:
        pool = self.supervisor._spawner.standbys
        assert pool is not None
        self.importing_at_registration = pool._forkserver is not None and pool._forkserver.process.poll() is None
        self.stopping.set()
        raise PortalUnavailableError("not yet")

    def close(self) -> None:
        pass


def test_the_node_starts_warming_up_before_it_registers(tmp_path: Path) -> None:
    supervisor = WorkerSupervisor(
        SupervisorConfig(worker_module=FAKE_WORKER, stop_grace_s=1.0, standbys=2, fork_standbys=True,
                         state_dir=tmp_path / "state")
    )
    stopping = threading.Event()
    portal = UnavailablePortal(supervisor, stopping)
    config = AgentConfig(
        portal_url=portal.base_url, token="t", node_name="node-a", address="127.0.0.1",
        backend="simulated", sim_devices=2, redis_url=REDIS_URL, report_interval_s=0.1, stop_grace_s=1.0,
        worker_module=FAKE_WORKER, log_level="INFO", state_dir=tmp_path / "state",
    )
    agent = Agent(config, SimulatedBackend(slots=2), portal, supervisor, stopping)  # type: ignore[arg-type]
    assert agent.run() == ExitCode.OK
    assert portal.importing_at_registration is True
