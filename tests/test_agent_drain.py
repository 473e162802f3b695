"""The agent's drain (agent.drain), a real agent process against the tests' stand-in for the
portal's agent API: SIGTERM (the default --on-term drain) or a drain command makes the agent tell
the portal in every report that its devices leave by a deadline, keep no standby and leave its
workers alone; once they are gone it sends its last report, saying it left, and exits 0. At the
deadline it stops what is left. A second SIGTERM stops at once."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from agent.drain import Drain, slurm_duration_s, slurm_job_at_term, term_cause
from elastic.wire import SLURM_GIVE_BACK_COMMENT, DrainCommand, StopCommand
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
    def squeue(start_ago_s: float, limit: str, state: str = "RUNNING", end_in_s: float | None = None,
               comment: str = "(null)", preempted_ago_s: float | None = None) -> Callable[[list[str], float], str]:
        def at(offset_s: float) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + offset_s))

        limit_s = slurm_duration_s(limit)
        end = at(end_in_s) if end_in_s is not None else at(limit_s - start_ago_s) if limit_s else "Unknown"

        def answer(command: list[str], timeout_s: float) -> str:
            if "PreemptTime" in command:  # its own query: a field of --Format only
                return (at(-preempted_ago_s) if preempted_ago_s is not None else "N/A") + "\n"
            return f"{state}|{at(-start_ago_s)}|{limit}|{end}|{comment}\n"

        return answer

    slurm = "42"
    # A one-hour limit signalled 30 s ahead: TERM 59.5 min in is the limit.
    assert term_cause(slurm, {}, 30, squeue(3570, "1:00:00")) == "slurm_time_limit"
    # 10 min in, the job's end moved to the end of a 20 s grace: a preemption (limit or none).
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00", end_in_s=20)) == "slurm_preemption"
    assert term_cause(slurm, {}, 30, squeue(600, "UNLIMITED", end_in_s=20)) == "slurm_preemption"
    # Its PreemptTime set, whatever its end time reads: a preemption.
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00", preempted_ago_s=0)) == "slurm_preemption"
    assert term_cause(slurm, {}, 30, squeue(3570, "1:00:00", preempted_ago_s=0)) == "slurm_preemption"
    # scancel: the job completes at once. The pool's idle give-back says so in its comment.
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00", "COMPLETING", end_in_s=0)) == "slurm_cancel"
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00", "CANCELLED", end_in_s=0)) == "slurm_cancel"
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00", "COMPLETING", 0, SLURM_GIVE_BACK_COMMENT)) == "slurm_pool_idle"
    # Nothing that says why (its end where its limit puts it; squeue silent): no claim of one.
    assert term_cause(slurm, {}, 30, squeue(600, "1:00:00"), deadline_s=0) == "slurm_term"
    assert term_cause(slurm, {}, 30, lambda command, timeout_s: "") == "slurm_term"
    assert term_cause(None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, 30) == "pod_eviction"
    assert term_cause(None, {}, 30) == "agent_stop"
    # SLURM_JOB_ID in the environment of an agent that serves no Slurm job (--slurm off): not Slurm's.
    assert term_cause(None, {"SLURM_JOB_ID": "42"}, 30) == "agent_stop"


@pytest.mark.parametrize(("text", "seconds"), [
    ("5", 300), ("5:30", 330), ("1:00:00", 3600), ("2-00", 172800), ("1-02:03", 93780), ("1-02:03:04", 93784),
    ("UNLIMITED", None), ("INFINITE", None), ("N/A", None), ("", None), ("1:2:3:4", None),
])
def test_slurm_durations(text: str, seconds: int | None) -> None:
    assert slurm_duration_s(text) == seconds


def test_an_squeue_that_never_answers_tells_nothing() -> None:
    tries: list[float] = []

    def failing(command: list[str], timeout_s: float) -> str:
        tries.append(timeout_s)
        raise OSError("squeue: not found")

    assert slurm_job_at_term("42", failing, deadline_s=0) is None
    assert term_cause("42", {}, 30, failing, deadline_s=0) == "slurm_term"
    assert len(tries) == 2, "asked once each time, however short the deadline"


def test_an_squeue_that_fails_at_first_is_asked_again_within_the_deadline() -> None:
    """A busy slurmctld (the preemption that sent the TERM keeps it busy) times out one query: the
    agent asks again, each try given what is left of the deadline, and still reads the cause."""
    preempted = time.strftime("%Y-%m-%dT%H:%M:%S")
    answers: list[str | Exception] = [
        subprocess.TimeoutExpired("squeue", 0.1), f"RUNNING|{preempted}|1:00:00|{preempted}|(null)",
        subprocess.CalledProcessError(1, "squeue"), preempted,
    ]
    timeouts: list[float] = []

    def busy(command: list[str], timeout_s: float) -> str:
        timeouts.append(timeout_s)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert term_cause("42", {}, 30, busy, deadline_s=5) == "slurm_preemption"
    assert not answers and len(timeouts) == 4
    assert all(0 < t <= 5 for t in timeouts) and timeouts == sorted(timeouts, reverse=True), timeouts


def test_an_answer_that_says_nothing_is_asked_again_until_it_does() -> None:
    """The controller's record of a preemption may show a moment after the TERM: a running job,
    its limit far and nothing preempted, is asked again (for a few seconds at most)."""
    readings = iter(["nothing", "nothing", "preempted"])
    reading = "nothing"

    def settling(command: list[str], timeout_s: float) -> str:
        nonlocal reading
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 600))
        if "PreemptTime" in command:
            return time.strftime("%Y-%m-%dT%H:%M:%S") if reading == "preempted" else "N/A"
        reading = next(readings)
        return f"RUNNING|{start}|1:00:00|Unknown|(null)"

    assert term_cause("42", {}, 30, settling, deadline_s=5) == "slurm_preemption"
