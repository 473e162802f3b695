"""The agent's drain (agent.drain), a real agent process against the tests' stand-in for the
portal's agent API: SIGTERM (the default --on-term drain) or a drain command makes the agent tell
the portal in every report that its devices leave by a deadline, keep no standby and leave its
workers alone; once they are gone it sends its last report, saying it left, and exits 0. At the
deadline it stops what is left. A second SIGTERM stops at once."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from agent.drain import Drain, slurm_duration_s, slurm_time_limit_at, term_cause
from elastic.wire import DrainCommand, StopCommand
from tests import test_agent_process as agent_process
from tests.test_agent_process import AgentProcess, FakePortal, send, worker_launch

# The fixtures of test_agent_process: a node name, the stand-in portal, and agents started on it.
node, portal, start_agent = agent_process.node, agent_process.portal, agent_process.start_agent

pytestmark = pytest.mark.slow


def running_worker(portal: FakePortal, node: str) -> int:
    portal.wait_for(lambda: portal.reports, "a first report")
    send(node, worker_launch(busy=True, step_s=0.05))
    [running] = portal.wait_for(lambda: portal.reports[-1].running, "a running worker")
    return running.pid


def test_sigterm_drains_and_the_agent_leaves_once_its_workers_are_gone(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent("--drain-deadline", "120")
    pid = running_worker(portal, node)
    asked = time.time()
    agent.process.send_signal(signal.SIGTERM)
    notice = portal.wait_for(lambda: portal.reports[-1].drain, "a report with the drain notice")
    assert notice.cause == "agent_stop" and asked + 100 < notice.deadline_at < time.time() + 121
    # The worker trains on while the portal moves the job: the agent stops nothing by itself.
    portal.wait_for(lambda: len([r for r in portal.reports if r.drain]) >= 3, "three reports while draining")
    assert [w.pid for w in portal.reports[-1].running] == [pid] and agent.process.poll() is None

    # The portal planned the job without this node: its worker here goes (here, told to stop).
    send(node, StopCommand(job_id=11, before_generation=2, reason="resize"))
    assert agent.process.wait(timeout=30) == 0
    last = portal.reports[-1]
    assert last.leaving and last.drain == notice and not last.running
    assert [e.reason for e in portal.events() if e.kind == "exited"] == ["stopped"]


def test_at_the_deadline_the_workers_left_are_stopped(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent("--drain-deadline", "2")
    pid = running_worker(portal, node)
    agent.process.send_signal(signal.SIGTERM)
    notice = portal.wait_for(lambda: portal.reports[-1].drain, "a report with the drain notice")
    assert agent.process.wait(timeout=30) == 0
    assert time.time() >= notice.deadline_at
    [exited] = [e for e in portal.events() if e.kind == "exited"]
    assert (exited.pid, exited.reason) == (pid, "stopped")
    assert portal.reports[-1].leaving
    assert "the drain's deadline passed with 1 worker(s) still here" in agent.stderr()


def test_a_drain_command_drains_as_an_operator_asked(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    running_worker(portal, node)
    send(node, DrainCommand(deadline_s=90))
    notice = portal.wait_for(lambda: portal.reports[-1].drain, "a report with the drain notice")
    assert notice.cause == "operator"
    send(node, StopCommand(job_id=11, before_generation=2, reason="resize"))
    assert agent.process.wait(timeout=30) == 0 and portal.reports[-1].leaving


def test_a_second_sigterm_stops_at_once(
    portal: FakePortal, node: str, start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent("--drain-deadline", "600")
    pid = running_worker(portal, node)
    agent.process.send_signal(signal.SIGTERM)
    portal.wait_for(lambda: portal.reports[-1].drain, "a report with the drain notice")
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=30) == 0
    [exited] = [e for e in portal.events() if e.kind == "exited"]
    assert (exited.pid, exited.reason) == (pid, "stopped")


def test_the_earliest_deadline_wins_and_the_first_cause_stays() -> None:
    now = [1000.0]
    drain = Drain(clock=lambda: now[0])
    assert drain.notice is None and not drain.overdue()
    drain.ask("slurm_preemption", 30)
    drain.ask("operator", 60)
    assert drain.notice is not None and (drain.notice.cause, drain.notice.deadline_at) == ("slurm_preemption", 1030)
    drain.ask("operator", 10)
    assert drain.notice.deadline_at == 1010
    now[0] = 1010
    assert drain.overdue()


def test_what_a_sigterm_means_where_the_agent_runs() -> None:
    def squeue(start_ago_s: float, limit: str) -> Callable[[list[str]], str]:
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - start_ago_s))
        return lambda command: f"{started}|{limit}\n"

    slurm = {"SLURM_JOB_ID": "42"}
    # A one-hour limit signalled 30 s ahead: TERM 59.5 min in is the limit; 10 min in, a preemption
    # (whose grace moves the job's end time near: the end time is no guide, the limit is).
    assert term_cause(slurm, 30, squeue(3570, "1:00:00")) == "slurm_time_limit"
    assert term_cause(slurm, 30, squeue(600, "1:00:00")) == "slurm_preemption"
    assert term_cause(slurm, 30, squeue(600, "UNLIMITED")) == "slurm_preemption", "no limit: a preemption"
    assert term_cause({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, 30) == "pod_eviction"
    assert term_cause({}, 30) == "agent_stop"


@pytest.mark.parametrize(("text", "seconds"), [
    ("5", 300), ("5:30", 330), ("1:00:00", 3600), ("2-00", 172800), ("1-02:03", 93780), ("1-02:03:04", 93784),
    ("UNLIMITED", None), ("INFINITE", None), ("N/A", None), ("", None), ("1:2:3:4", None),
])
def test_slurm_durations(text: str, seconds: int | None) -> None:
    assert slurm_duration_s(text) == seconds


def test_an_squeue_that_fails_gives_no_limit() -> None:
    def failing(command: list[str]) -> str:
        raise OSError("squeue: not found")

    assert slurm_time_limit_at("42", failing) is None
