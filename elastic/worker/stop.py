"""The graceful stop: SIGTERM or SIGINT only sets a flag. The trainer carries the flag in the
per-step collective, so that every rank learns of a stop asked of any one of them at the same
step boundary, finishes that step, and exits after rank 0 has saved it.

Before that, while the worker still starts (imports torch, loads the job's code, builds the model
and makes its warm-up pass: seconds on a busy machine, minutes if the job's code is slow), it holds
no training state and nobody waits for it: a stop then raises StoppedStarting in the main thread,
which unwinds the start at once. The worker leaves that mode (`settle`) before it meets its peers,
where the rendezvous honours a stop at its next check (a worker with no state goes at once).

Who may stop a worker with SIGTERM: its agent (the process that started it and signals it:
AGENT_PID_ENV), the worker itself (its heartbeat, told to leave), and, once that agent is gone,
anyone (an agent that re-adopted it after a restart has another pid). A cluster engine that stops
the agent signals every process of the agent's job: Slurm's `scancel` sends SIGTERM to the batch
step's whole process tree (proctrack/linuxproc) or cgroup (proctrack/cgroup), and a service
manager may do the same to its unit. Neither a new session nor a process group escapes that, so
the worker tells senders apart: `hold_term` blocks SIGTERM in the main thread before any thread
starts (every thread inherits the block), and a TermGate takes each TERM in a thread of its own
with `sigwaitinfo`, which says who sent it. One from its agent or itself is passed on to the main
thread as the stop above; one from anyone else is logged once and dropped: the agent decides
(it drains its node, and its workers leave when the portal says so). SIGINT is not held."""

from __future__ import annotations

import _thread
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
WAKE_SIGNAL = signal.SIGURG
"""What the gate sends the main thread after passing a TERM on: its handler does nothing, but its
arrival interrupts a blocking call there (a sleep, a socket's wait), so that the stop's handler
runs at once, as it did when the TERM itself reached the main thread."""
AGENT_PID_ENV = "BUNGEE_AGENT_PID"
"""The pid of the process whose SIGTERM stops this worker: whoever starts workers (the node's
agent, the local runner of elastic.worker.local) sets it to its own, as it is also who signals
them (a fork server's children and standbys included). Unset: the worker's parent."""

_held = False
"""Whether this process holds SIGTERM (`hold_term`)."""
_gate: TermGate | None = None
"""This process's TermGate, once `guard_term` has started it."""


class StoppedStarting(BaseException):  # noqa: N818 - a way out, not an error
    """A stop arrived while the worker was still starting. A BaseException, so that the job's
    own code and the build's `except Exception` (which turn errors into the job's failure) let
    it through."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signal_number).name} while starting")
        self.signal_number = signal_number


class StopRequest:
    """Whether this process was asked to stop, and by which signal."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._starting = False

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def install(self, starting: bool = False) -> None:
        """Handle STOP_SIGNALS from now on by setting the flag and, while `starting` (until
        `settle`), by raising StoppedStarting too. Main thread only. A TERM reaches the handler
        directly, or, where a TermGate holds it, through the gate, from the agent only."""
        self._starting = starting
        for signal_number in STOP_SIGNALS:
            signal.signal(signal_number, self._handle)

    def settle(self) -> None:
        """The start is over: from now on a stop only sets the flag."""
        self._starting = False

    def _handle(self, signal_number: int, frame: FrameType | None) -> None:
        self.signal_number = signal_number
        if self._starting:
            self._starting = False  # once: a second signal during the unwinding only sets the flag
            raise StoppedStarting(signal_number)


def agent_pid(environ: Mapping[str, str] | None = None) -> int:
    """The pid of this worker's agent: AGENT_PID_ENV, else this process's parent. Raises
    ValueError for a value that is not a pid."""
    text = (os.environ if environ is None else environ).get(AGENT_PID_ENV, "").strip()
    if not text:
        return os.getppid()
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{AGENT_PID_ENV}={text!r} is not a process id")
    return int(text)


def hold_term() -> None:
    """Blocks SIGTERM in the calling thread, and so in every thread it starts from now on: call it
    in the main thread before any other starts (a thread that does not hold it would take a TERM
    past the gate). A TERM then waits for a TermGate. A process this one forks (the job's data
    loaders) starts with it released, as before; one it executes inherits the block (the kernel
    keeps a signal mask across exec)."""
    global _held
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if not _held:
        os.register_at_fork(after_in_child=_release_term)
    _held = True


def _release_term() -> None:
    global _held, _gate
    _held, _gate = False, None  # a forked child has no gate thread
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def guard_term(agent: int) -> TermGate:
    """Holds SIGTERM and starts this process's TermGate for `agent`; the one started already, if
    any (a standby starts it before it becomes a worker). Main thread, before any other starts."""
    global _gate
    if _gate is None:
        _gate = TermGate(agent).start()
    return _gate


class TermGate:
    """Takes each SIGTERM this process receives (held by `hold_term`) in a daemon thread and
    calls `obey` for one from `agent`, from this process itself, or from anyone once `agent` is
    gone; writes `say` once for any other sender, and drops it. By default `obey` does what the
    TERM would have done had it not been held: the main thread's handler (StopRequest's) runs, or,
    where SIGTERM has its default action (a standby waiting), the process ends."""

    def __init__(self, agent: int, obey: Callable[[], None] | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.agent = agent
        self._obey = obey or self._stop_main_thread
        self._main = threading.main_thread().ident
        self._say = say or _to_stderr
        self._told = False
        try:  # a pidfd tells the agent's end even if its pid is taken again
            self._agent_fd: int | None = os.pidfd_open(agent)
        except ProcessLookupError:
            self._agent_fd = None  # gone already
        except OSError:
            self._agent_fd = -1  # no pidfd here: os.kill(agent, 0) asks instead
        self._thread = threading.Thread(target=self._run, name="term-gate", daemon=True)

    def start(self) -> TermGate:
        """Holds SIGTERM in the calling thread (the main thread, before any other starts) and
        starts taking it."""
        hold_term()
        signal.signal(WAKE_SIGNAL, _wake)
        self._thread.start()
        return self

    def _stop_main_thread(self) -> None:
        handler = signal.getsignal(signal.SIGTERM)
        if handler == signal.SIG_DFL:
            # Its default action, from this thread: the process ends on it.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.raise_signal(signal.SIGTERM)
        elif callable(handler):
            _thread.interrupt_main(signal.SIGTERM)  # the main thread runs the TERM's handler...
            if self._main is not None:
                signal.pthread_kill(self._main, WAKE_SIGNAL)  # ...now, even if a call there blocks

    def agent_alive(self) -> bool:
        if self._agent_fd is None:
            return False
        if self._agent_fd == -1:
            try:
                os.kill(self.agent, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True  # another uid's (a root agent of a confined job): there
            return True
        readable, _, _ = select.select([self._agent_fd], [], [], 0)
        return not readable  # a pidfd turns readable when its process ends

    def obeys(self, sender: int) -> bool:
        """Whether a TERM from pid `sender` stops this worker (0: from outside this process's
        pid namespace, a container runtime's, which signals every process of the container)."""
        return sender in (self.agent, os.getpid()) or not self.agent_alive()

    def take(self, sender: int) -> bool:
        """Acts on a TERM from `sender`; returns whether it was obeyed."""
        if self.obeys(sender):
            self._obey()
            return True
        if not self._told:
            self._told = True
            self._say(f"TERM from pid {sender} (not this node's agent, pid {self.agent}): the agent decides")
        return False

    def _run(self) -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            self.take(info.si_pid)


def _wake(_signum: int, _frame: FrameType | None) -> None:
    """WAKE_SIGNAL's handler: its arrival was the point."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
