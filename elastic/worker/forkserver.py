"""A fork server for worker processes on CPU: `python -m elastic.worker.forkserver`, started by
ForkServer.

Most of a worker's start is its imports: torch, torch.distributed, torch._dynamo, the worker
runtime and the workload's libraries take 3.5 CPU-s on a quiet 2-core VM, and far more beside
training. A node that starts a standby on every free device, and a test that starts a dozen
workers, paid that in every process. The server pays it once: it imports
elastic.worker.standby.WARM_MODULES, then forks each process asked of it. The child takes the
stdin, stdout and stderr it was sent (file descriptors over the socket), the environment it was
given in place of the server's, its own session if asked, the CPU cores it was given, and runs its
module as `python -m` would, ending with that module's exit code. The fork costs milliseconds and
shares the imported libraries' memory copy-on-write.

What makes the fork safe: the server runs no torch operation (no intra-op thread pool, no OpenMP
region exists yet) and touches no GPU; a child makes its own when it needs them. Only CPU workers
are forked: a GPU's driver must not be initialised before a fork, and the driver cannot be tested
on the machines this runs on, so a GPU standby still starts as a process of its own
(agent.standby). Variables read by the interpreter or a native library while it loads
(STARTUP_PREFIXES) cannot change after the imports: a request whose values differ from the
server's is refused, and its caller starts the process the ordinary way. Python's `random`
reseeds itself in a forked child; numpy's global generator is reseeded here, as a fresh process's
would be.

The protocol, on a stream socket pair, each message a 4-byte length then JSON, one model per
message (CallerMessage, ServerMessage; `kind` tells them apart):

    server -> caller   Ready(pid)                            once its imports are done
    caller -> server   Spawn(request)  + 3 descriptors       (stdin, stdout, stderr)
    server -> caller   Spawned(pid) | Refused(why)
    server -> caller   Exited(pid, code)                     code as Popen's returncode
    caller -> server   Reap(pid)

The server keeps an ended child unreaped until its caller says so: until then its pid, and its
process group, cannot be another process's, so the caller may still signal them (the agent kills
what a worker left behind in its group). The end of the socket (the caller died or closed it) ends
the server; its children live on, as workers outlive their agent.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from elastic.worker.confine import make_undumpable
from elastic.worker.stop import AGENT_PID_ENV

log = logging.getLogger(__name__)

STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GOMP_", "KMP_", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA_", "THP_")
"""Variables that a process reads while it starts or loads its libraries: a forked child must
have the server's values (OMP_NUM_THREADS excepted: the worker sets its threads itself;
PYTHONUNBUFFERED excepted: the child sets its streams up as it says)."""
_STARTUP_EXCEPTIONS = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED"})
READY_TIMEOUT_S = 120.0
"""The longest the server may take to import the worker runtime (seconds on a loaded 2-core
machine; a cold worker takes as long)."""
REPLY_TIMEOUT_S = 10.0
"""The longest a fork may take to be answered."""
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 16 << 20


class Request(BaseModel):
    """One process to fork."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: str
    """Run as `python -m MODULE`."""
    args: list[str] = []
    env: dict[str, str]
    """Its whole environment."""
    new_session: bool = False
    cpu_affinity: list[int] = []
    """Its cores (empty: the server's)."""


def startup_differences(env: Mapping[str, str], server_env: Mapping[str, str]) -> list[str]:
    """The names of the start-up variables whose values differ between `env` and `server_env`."""
    names = {name for name in (*env, *server_env) if name.startswith(STARTUP_PREFIXES)} - _STARTUP_EXCEPTIONS
    return sorted(name for name in names if env.get(name) != server_env.get(name))


# --- messages -----------------------------------------------------------------------------------


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ready(_Message):
    """The server's imports are done: it forks from now on."""

    kind: Literal["ready"] = "ready"
    pid: int


class Spawn(_Message):
    """Fork `request` (its stdin, stdout and stderr come as the message's three descriptors)."""

    kind: Literal["spawn"] = "spawn"
    request: Request


class Spawned(_Message):
    kind: Literal["spawned"] = "spawned"
    pid: int


class Refused(_Message):
    """The request was not forked: the caller starts the process the ordinary way."""

    kind: Literal["refused"] = "refused"
    why: str = Field(max_length=2000)


class Exited(_Message):
    """A child ended (not reaped yet); `code` as Popen's returncode (-N: signal N)."""

    kind: Literal["exited"] = "exited"
    pid: int
    code: int


class Reap(_Message):
    """The caller is done with an ended child: its pid may now be another process's."""

    kind: Literal["reap"] = "reap"
    pid: int


CallerMessage = Annotated[Spawn | Reap, Field(discriminator="kind")]
ServerMessage = Annotated[Ready | Spawned | Refused | Exited, Field(discriminator="kind")]
_CALLER_MESSAGE: TypeAdapter[Spawn | Reap] = TypeAdapter(CallerMessage)
_SERVER_MESSAGE: TypeAdapter[Ready | Spawned | Refused | Exited] = TypeAdapter(ServerMessage)


def _send(sock: socket.socket, message: _Message, fds: Sequence[int] = ()) -> None:
    body = message.model_dump_json().encode()
    header = _HEADER.pack(len(body))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(body)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the socket closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]] | None:
    """The next message's JSON and the descriptors sent with it; None at the socket's end."""
    fds: list[int] = []
    if max_fds:
        data, fds, _flags, _address = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        data = sock.recv(_HEADER.size)
    if not data:
        return None
    data += _receive_exactly(sock, _HEADER.size - len(data))
    (size,) = _HEADER.unpack(data)
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes")
    return _receive_exactly(sock, size), fds


# --- the server ---------------------------------------------------------------------------------


def _child(request: Request, fds: list[int]) -> None:
    """In the forked child: becomes the requested process and runs its module; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if request.new_session:
            os.setsid()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        # Its streams as a fresh interpreter would set them up on these descriptors.
        unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
        sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)  # type: ignore[union-attr]
        if request.cpu_affinity:
            os.sched_setaffinity(0, request.cpu_affinity)
        sys.modules["setproctitle"].setproctitle(" ".join([sys.executable, "-m", request.module, *request.args]))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # from the system's entropy, as at a fresh import
        sys.argv = [request.module, *request.args]
        import runpy


        # Run as `python -m` does: a fresh __main__, not the module the server imported.
        if not hasattr(sys.modules.get(request.module), "__path__"):
            sys.modules.pop(request.module, None)

        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, int | None):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _term_is_the_callers(_signum: int, _frame: object) -> None:
    """The server's SIGTERM: dropped (the end of its socket ends it)."""


def serve(sock: socket.socket, worker_module: str | None = None) -> int:
    """Forks what the caller asks for until the socket ends (the caller is gone), once it has
    imported what standbys for `worker_module` import (by default the platform's worker's)."""
    import setproctitle

    setproctitle.getproctitle()  # its set-up, while argv's and the environment's memory are as they started

    from elastic.worker.standby import WARM_MODULES, warm_modules

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for its caller; its socket's end ends it
    # So is a TERM to the caller's whole process tree (Slurm's scancel, a service manager's stop):
    # the caller, draining, still needs to hear of its children's ends. A handler, not SIG_IGN,
    # which a child would keep (the child puts the default back anyway).
    signal.signal(signal.SIGTERM, _term_is_the_callers)
    server_env = dict(os.environ)
    for name in warm_modules(worker_module) if worker_module else WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: set[int] = set()
    """Forked and not reaped."""
    ended: set[int] = set()
    """Of those, the ones the caller has been told have ended."""
    imported_env = {name: value for name, value in os.environ.items() if name not in server_env}
    """What the imports set in the environment (torch sets KMP_DUPLICATE_LIB_OK, for one): a
    child gets it where its own environment does not say otherwise, as a fresh import would."""
    _send(sock, Ready(pid=os.getpid()))
    while True:
        for key, _events in selector.select():
            if key.fileobj == wake_read:
                try:
                    os.read(wake_read, 4096)
                except BlockingIOError:
                    pass
                continue
            received = _receive(sock, max_fds=3)
            if received is None:
                return 0
            body, fds = received
            try:
                message = _CALLER_MESSAGE.validate_json(body)
            except ValueError as err:  # pydantic's ValidationError is one
                for fd in fds:
                    os.close(fd)
                _send(sock, Refused(why=f"not a message of the protocol: {err}"[:2000]))
                continue
            if isinstance(message, Reap):
                if message.pid in ended:  # never one still running: the caller reaps what it was told ended
                    os.waitpid(message.pid, 0)
                    children.discard(message.pid)
                    ended.discard(message.pid)
                continue
            request = message.request
            try:
                if len(fds) != 3:
                    raise ValueError(f"{len(fds)} descriptors sent, not 3 (stdin, stdout, stderr)")
                different = startup_differences(request.env, server_env)
                if different:
                    raise ValueError(f"start-up variables differ from the server's: {', '.join(different)}")
            except ValueError as err:
                for fd in fds:
                    os.close(fd)
                _send(sock, Refused(why=str(err)[:2000]))
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                sock.close()
                os.close(wake_read)
                os.close(wake_write)
                _child(request.model_copy(update={"env": {**imported_env, **request.env}}), fds)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, Spawned(pid=pid))
        for pid in sorted(children - ended):
            # Without reaping it: its pid stays the caller's to signal until it says "reap".
            result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if result is not None and result.si_pid == pid:
                code = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
                ended.add(pid)
                _send(sock, Exited(pid=pid, code=code))


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) not in (1, 2) or not args[0].isdigit():
        print("usage: python -m elastic.worker.forkserver FD [WORKER_MODULE] (started by ForkServer)", file=sys.stderr)
        return 2
    # Not dumpable, nor the children it forks until they are confined as a job: where jobs keep
    # the agent's uid, none may read its memory or see the machine's files through /proc/PID/root.
    make_undumpable()
    sock = socket.socket(fileno=int(args[0]))
    try:
        return serve(sock, args[1] if len(args) == 2 else None)
    except (EOFError, ConnectionError):
        return 0


# --- the caller's side --------------------------------------------------------------------------


class ForkServerError(Exception):
    """The server could not fork the process (it refused, it is gone, or it did not answer)."""


class ForkedProcess:
    """A process the server forked, with the part of subprocess.Popen's interface that callers use.
    Its exit code comes from the server; `wait_ended` waits for its end without reaping it. If the
    server is gone before it ends (killed: it outlives its caller's use of it otherwise), its end
    is still seen but its code is unknown: `ended` is true and `returncode` stays None."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.stdin: IO[bytes] | None = None
        """Set by a caller that sent it a pipe's read end and keeps the write end."""
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self.returncode: int | None = None
        self._code: int | None = None
        self._ended = threading.Event()
        self._reaped = False

    def _exited(self, code: int | None) -> None:
        self._code = code
        self._ended.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Waits until it has ended (or its server is gone); it stays unreaped. False on timeout."""
        return self._ended.wait(timeout)

    def poll(self) -> int | None:
        if self._ended.is_set():
            self._reap()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it has ended (None: unknown, its server went first)."""
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        self._reap()
        return self.returncode

    def _reap(self) -> None:
        if self._reaped:
            return
        self._reaped = True
        self.returncode = self._code
        self.server._reap(self.pid)

    def send_signal(self, signum: int) -> None:
        if not self._reaped:  # until then its pid is still its own
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The caller's end of a fork server: starts it with `env` (the start-up variables its
    children must share) and forks processes through it. Thread-safe."""

    def __init__(self, env: Mapping[str, str], python: str = sys.executable, worker_module: str | None = None) -> None:
        """`worker_module`: the module its children mostly run, whose standby imports it makes
        (elastic.worker.standby.warm_modules); None: the platform's worker's."""
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        try:
            self.process = subprocess.Popen(
                [python, "-m", "elastic.worker.forkserver", str(theirs.fileno()), *([worker_module] if worker_module else [])],
                env=self.env,
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
            )
        finally:
            theirs.close()
        self._lock = threading.Lock()
        self._replies: list[Spawned | Refused] = []
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._ready = threading.Event()
        """Set once it said it is ready, or once it is gone (then `ready` is false)."""
        self._lost = False
        self._closed = False
        self.started_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        """Whether its imports are done and it is still there."""
        return self._ready.is_set() and not self._gone()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        return self._ready.wait(timeout_s) and not self._gone()

    def _gone(self) -> bool:
        return self._closed or self._lost or self.process.poll() is not None

    def spawn(
        self,
        module: str,
        env: Mapping[str, str],
        stdin: int,
        stdout: int,
        stderr: int,
        args: Sequence[str] = (),
        new_session: bool = False,
        cpu_affinity: Sequence[int] = (),
    ) -> ForkedProcess:
        """Forks `python -m module args` with these descriptors as its stdin, stdout and stderr
        (they are the caller's still: it closes its copies). Raises ForkServerError if the server
        is not ready, refuses (start-up variables that differ) or does not answer."""
        # The caller signals its children (ForkedProcess.send_signal): its TERM is the one a
        # worker obeys (elastic.worker.stop), unless the caller names another process.
        env = {AGENT_PID_ENV: str(os.getpid()), **env}
        request = Request(
            module=module, args=list(args), env=env, new_session=new_session, cpu_affinity=sorted(cpu_affinity)
        )
        if not self.ready:
            raise ForkServerError("the fork server is not ready")
        with self._lock:
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            with self._replied:
                try:
                    _send(self._sock, Spawn(request=request), [stdin, stdout, stderr])
                except OSError as err:
                    raise ForkServerError(f"the fork server is gone: {err}") from err
                while not self._replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._gone():
                        raise ForkServerError(f"the fork server did not answer in {REPLY_TIMEOUT_S:.0f} s")
                    self._replied.wait(min(left, 0.5))
                reply = self._replies.pop(0)
        if isinstance(reply, Refused):
            raise ForkServerError(f"the fork server refused: {reply.why}")
        return self._children[reply.pid]

    def _read(self) -> None:
        try:
            while True:
                received = _receive(self._sock)
                if received is None:
                    break
                message = _SERVER_MESSAGE.validate_json(received[0])
                if isinstance(message, Ready):
                    self._ready.set()
                elif isinstance(message, Exited):
                    child = self._children.get(message.pid)
                    if child is not None:
                        child._exited(message.code)
                else:
                    if isinstance(message, Spawned):
                        self._children[message.pid] = ForkedProcess(self, message.pid)
                    with self._replied:
                        self._replies.append(message)
                        self._replied.notify_all()
        except (OSError, EOFError, ValueError) as err:
            if not self._closed:
                log.warning("lost the fork server (pid %d): %s", self.process.pid, err)
        finally:
            self._lost = True
            self._ready.set()  # no waiter waits for a server that is gone
            with self._replied:
                self._replied.notify_all()
        # Its children still running are no longer told of: each is watched through a pidfd
        # until it ends, its code unknown.
        for child in list(self._children.values()):
            if not child.ended:
                threading.Thread(target=_watch_orphan, args=(child,), daemon=True).start()

    def _reap(self, pid: int) -> None:
        self._children.pop(pid, None)
        with self._lock:
            try:
                _send(self._sock, Reap(pid=pid))
            except OSError:
                pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the server (its children live on) and waits for it. One still importing reads
        its socket only once its imports are done: it is killed, having forked nothing."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if not self._ready.is_set():
            self.process.kill()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _watch_orphan(child: ForkedProcess) -> None:
    try:
        pidfd = os.pidfd_open(child.pid)
    except ProcessLookupError:
        child._exited(None)
        return
    try:
        select.select([pidfd], [], [])  # readable once it has ended
    finally:
        os.close(pidfd)
    child._exited(None)


_shared: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}
_shared_lock = threading.Lock()


def shared_server(env: Mapping[str, str], python: str = sys.executable) -> ForkServer:
    """A fork server of this process for children with `env`'s start-up variables, started on
    first use and kept until this process ends (its socket's end ends it)."""
    key = (python, tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES))))
    with _shared_lock:
        server = _shared.get(key)
        if server is None or server._gone():
            server = _shared[key] = ForkServer(env, python)
        return server


if __name__ == "__main__":
    # Without the interpreter's teardown: with torch imported it takes seconds, and the agent that
    # ends the server (on its way out, a drained agent's last step) waits for it. Nothing is left
    # to flush but the standard streams; the children are processes of their own.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
