"""What the agent does to keep a job's code from the platform, process by process (agent.isolation,
elastic.worker.confine): the agent is not dumpable, so a process of its uid without
CAP_SYS_PTRACE cannot read its environment; the files a job hands over are read only if they are
the job's own, through what was checked; a confined process sees neither the hidden directories nor
the token file nor the machine's /tmp, and still reaches an interpreter kept under a closed
directory. The whole platform with confined jobs: test_job_confinement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from agent.artifacts import ArtifactUploader
from agent.isolation import ForeignFileError, JobIsolation, job_files
from elastic.artifacts import ARTIFACT_NAMES
from elastic.wire import WorkerEvent
from elastic.worker.confine import Confinement

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="switching uids and mount namespaces needs root")
PROJECT = str(Path(__file__).resolve().parent.parent)


# --- the agent's memory ---------------------------------------------------------------------

TARGET = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "undumpable":
        from agent.isolation import make_undumpable
        make_undumpable()
    print("ready", flush=True)
    time.sleep(30)
""")


def _environ_as_reader(undumpable: bool) -> subprocess.CompletedProcess[str]:
    """Reads the environ of a process holding a secret, from a process of the same uid; both lack
    a capability (as a job of an agent running as a user does)."""
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]  # uid 0 with no capability: as a user
    target = subprocess.Popen(
        [*drop, sys.executable, "-c", TARGET, PROJECT, "undumpable" if undumpable else "dumpable"],
        env={**os.environ, "BUNGEE_AGENT_TOKEN": "the-secret"}, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        return subprocess.run([*drop, "cat", f"/proc/{target.pid}/environ"], capture_output=True, text=True, timeout=10)
    finally:
        target.kill()
        target.wait()


@needs_root
def test_an_undumpable_agents_environment_is_not_readable_by_its_own_uid() -> None:
    read = _environ_as_reader(undumpable=False)
    assert "the-secret" in read.stdout, "without it, the same uid reads the environment (the test's control)"
    read = _environ_as_reader(undumpable=True)
    assert read.returncode != 0 and "Permission denied" in read.stderr and "the-secret" not in read.stdout


# --- files a job hands over -------------------------------------------------------------------


def test_only_the_jobs_own_regular_files_are_read(tmp_path: Path) -> None:
    own = tmp_path / "model.pt"
    own.write_bytes(b"weights")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "node-token").write_text("token")
    (tmp_path / "link.pt").symlink_to(secret / "node-token")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "linked-dir").symlink_to(secret)
    with job_files(tmp_path, ["model.pt"], owner=os.geteuid()) as opened:
        own.write_bytes(b"swapped")  # after the check: the same file, so the same bytes
        assert opened["model.pt"].read_bytes() == b"swapped"
        own.unlink()
        own.write_bytes(b"another file")
        assert opened["model.pt"].read_bytes() == b"swapped", "what was checked is what is read"
    for directory, name, why in ((tmp_path, "link.pt", "is a link"), (tmp_path, "fifo.pt", "not a regular file"),
                                 (tmp_path, "secret", "not a regular file"),
                                 (tmp_path / "linked-dir", "node-token", "linked-dir is a link")):
        with pytest.raises(ForeignFileError, match=why), job_files(directory, [name], owner=None):
            pass
    with pytest.raises(ForeignFileError, match=f"belongs to uid {os.geteuid()}, not the job's 123456"), \
            job_files(tmp_path, ["model.pt"], owner=123456):
        pass


class Portal:
    def __init__(self) -> None:
        self.taken: dict[int, dict[str, bytes]] = {}

    def upload_artifacts(self, job_id: int, files: dict[str, Path]) -> None:
        self.taken[job_id] = {name: path.read_bytes() for name, path in files.items()}


def _upload(tmp_path: Path, directory: Path, job_id: int, owner: int) -> dict[int, dict[str, bytes]]:
    """What the portal took of an "artifacts" event of job `job_id` naming `directory`."""
    event = WorkerEvent(job_id=job_id, generation=1, rank=0, kind="artifacts", at=time.time(), step=3,
                        message=str(directory))
    portal = Portal()
    state = tmp_path / f"state-{time.monotonic_ns()}"
    ArtifactUploader(portal, threading.Event(), state, owner=lambda job: owner).submit(event)
    deadline = time.monotonic() + 10
    while (not (state / "pending-artifacts").is_dir() or list((state / "pending-artifacts").glob("*.json"))) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    return portal.taken


def test_artifacts_that_are_not_the_jobs_own_are_not_uploaded(tmp_path: Path) -> None:
    """A job's code writes the 'artifacts' event itself: it may name any directory of the node,
    another job's run directory among them. Only its own run's files, that its uid owns, leave."""
    others = tmp_path / "job-8-20261128T000000" / "artifacts"
    others.mkdir(parents=True)
    for name in ARTIFACT_NAMES:
        (others / name).write_bytes(b"job 8's " + name.encode())
    assert _upload(tmp_path, others, 9, os.geteuid()) == {}, "another job's run directory"
    assert _upload(tmp_path, others, 8, 200_008) == {}, "files its uid does not own"
    disguised = tmp_path / "job-9-20261128T000000"
    disguised.mkdir()
    (disguised / "artifacts").symlink_to(others)
    assert _upload(tmp_path, disguised / "artifacts", 9, os.geteuid()) == {}, "a link to another's"
    assert set(_upload(tmp_path, others, 8, os.geteuid())[8]) == set(ARTIFACT_NAMES)


# --- a confined process ------------------------------------------------------------------------

PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from elastic.worker.confine import Confinement, confine
    confine(Confinement.from_json(sys.argv[2]))
    def attempt(what):
        try:
            return "got " + repr(what())[:80]
        except OSError as err:
            return "refused: " + type(err).__name__
    print(json.dumps({
        "uid": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
        "token": attempt(lambda: open(sys.argv[3]).read()),
        "state": attempt(lambda: sorted(os.listdir(sys.argv[4]))),
        "other job": attempt(lambda: os.listdir(os.path.join(sys.argv[4], "jobs", "job-8"))),
        "own code": attempt(lambda: open(os.path.join(sys.argv[4], "jobs", "job-7", "code", "task.py")).read()),
        "tmp": attempt(lambda: sorted(os.listdir("/tmp"))),
        "closed": attempt(lambda: sorted(os.listdir(sys.argv[5]))),
        "reached": attempt(lambda: open(os.path.join(sys.argv[5], "runtime", "lib.py")).read()),
        "parent": attempt(lambda: os.kill(os.getppid(), 0)),
        "write own": attempt(lambda: open(os.path.join(os.environ["HOME"], "f"), "w").write("x")),
        "write code": attempt(lambda: open(os.path.join(sys.argv[4], "jobs", "job-7", "code", "x"), "w").write("x")),
        "home": os.environ["HOME"], "cwd": os.getcwd(),
    }))
""")


@needs_root
def test_a_confined_process_sees_only_its_own(tmp_path: Path) -> None:
    base = Path("/var/tmp") / f"bungee-confine-test-{os.getpid()}"  # outside the test's /tmp
    try:
        state = base / "state"
        (state / "jobs" / "job-8" / "code").mkdir(parents=True)
        (state / "jobs" / "job-7" / "code").mkdir(parents=True)
        (state / "jobs" / "job-7" / "code" / "task.py").write_text("print('mine')")
        (state / "workers").mkdir()
        token = base / "agent.token"
        token.write_text("the-token")
        token.chmod(0o644)  # even a file anyone may read: out of sight
        closed = base / "closed"  # as a 0700 home holding the interpreter
        (closed / "runtime").mkdir(parents=True)
        (closed / "runtime" / "lib.py").write_text("x = 1")
        (closed / "private").mkdir()
        closed.chmod(0o700)
        outside = Path("/tmp") / f"bungee-outside-{os.getpid()}"
        outside.write_text("the machine's")
        isolation = JobIsolation(300_000, 1 << 20, (str(state), str(token)))
        run_dir = base / "runs" / "job-7-x"
        (base / "runs").mkdir()
        confinement = isolation.confinement(
            7, state, str(run_dir),
            {sys.prefix, str(Path(sys.base_prefix).resolve()), PROJECT, str(closed / "runtime")},
        )
        done = subprocess.run(
            [sys.executable, "-c", PROBE, PROJECT, confinement.to_json(), str(token), str(state), str(closed)],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["uid"] == [300_007, 300_007, 300_007, []]
        assert seen["token"] == "got ''", seen  # /dev/null in its place
        assert seen["state"] == "got ['jobs']" and seen["other job"].startswith("refused"), seen
        assert seen["own code"] == "got \"print('mine')\"", seen
        assert outside.name not in seen["tmp"], seen
        assert seen["closed"] == "got ['runtime']" and seen["reached"] == "got 'x = 1'", seen
        assert seen["parent"] == "refused: PermissionError", seen
        assert seen["write own"] == "got 1" and seen["write code"].startswith("refused"), seen
        assert seen["home"] == seen["cwd"] == str(state / "jobs" / "job-7" / "home")
        assert run_dir.stat().st_uid == 300_007 and (run_dir.stat().st_mode & 0o777) == 0o700
        assert not (state / "jobs" / "job-7" / "tmp" / "f").exists()
    finally:
        outside.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_a_confinement_never_runs_a_job_as_root() -> None:
    from elastic.worker.confine import ConfinementError

    for uid, gid in ((0, 5), (5, 0)):
        text = Confinement(uid, gid, "/h", "/t").to_json()
        with pytest.raises(ConfinementError, match="must be unprivileged"):
            Confinement.from_json(text)


NESTED = textwrap.dedent("""
    import ctypes, json, os, sys
    sys.path.insert(0, sys.argv[1])
    import elastic.worker.confine as confining
    from elastic.worker.confine import CONFINED_ENV, Confinement, confine
    # As root here: first become the agent's uid (as an agent that is not root would be) ...
    confine(Confinement.from_json(sys.argv[2]))
    del os.environ[CONFINED_ENV]
    confining._confined = False
    # ... then confine a job as that agent can: without root, in user namespaces.
    confine(Confinement.from_json(sys.argv[3]))
    base = sys.argv[4]
    libc = ctypes.CDLL(None, use_errno=True)
    def attempt(what):
        try:
            return "got " + repr(what())[:80]
        except OSError as err:
            return "refused: " + (os.strerror(err.errno) if err.errno else type(err).__name__)
    def unmount(path):
        if libc.umount2(path.encode(), 2) != 0:  # MNT_DETACH
            raise OSError(ctypes.get_errno(), "umount")
        return "unmounted"
    print(json.dumps({
        "uid": os.getuid(),
        "state": attempt(lambda: sorted(os.listdir(os.path.join(base, "state")))),
        "token": attempt(lambda: open(os.path.join(base, "state", "node-token")).read()),
        "agent's files": attempt(lambda: open(os.path.join(base, "agent-files", "x"), "w").write("x")),
        "own run": attempt(lambda: open(os.path.join(base, "runs", "job-4-x", "f"), "w").write("x")),
        "own home": attempt(lambda: open(os.path.join(os.environ["HOME"], "f"), "w").write("x")),
        "unmount the cover": attempt(lambda: unmount(os.path.join(base, "state"))),
        "dumpable": libc.prctl(3, 0, 0, 0, 0),
    }))
""")


@needs_root
def test_an_agent_that_is_not_root_confines_its_jobs_in_user_namespaces(tmp_path: Path) -> None:
    """The agent's uid here is 300,100 (made so by a first, root, confinement); its job keeps
    that uid: what hides the agent's state from it, and keeps it from writing the agent's files,
    is its own user and mount namespaces, whose mounts it cannot undo."""
    agent_uid = 300_100
    base = Path("/var/tmp") / f"bungee-userns-test-{os.getpid()}"
    try:
        for directory in ("state", "agent-files", "runs", "outer-home", "outer-tmp"):
            (base / directory).mkdir(parents=True)
        (base / "state" / "node-token").write_text("the-token")
        subprocess.run(["chown", "-R", f"{agent_uid}:{agent_uid}", str(base)], check=True)
        reach = (sys.prefix, str(Path(sys.base_prefix).resolve()), PROJECT)
        agent = Confinement(agent_uid, agent_uid, str(base / "outer-home"), str(base / "outer-tmp"), reach=reach)
        state = base / "state"
        job = JobIsolation(0, 1 << 20, (str(state),), unprivileged=True)
        # The job's confinement as that agent would make it (its directories are made as root here:
        # the same paths and modes, owned by the agent's uid).
        made = job.confinement(4, state, str(base / "runs" / "job-4-x"), reach)
        made = Confinement(agent_uid, agent_uid, made.home, made.tmp, made.hide, made.keep, made.reach, unprivileged=True)
        subprocess.run(["chown", "-R", f"{agent_uid}:{agent_uid}", str(base)], check=True)
        done = subprocess.run([sys.executable, "-c", NESTED, PROJECT, agent.to_json(), made.to_json(), str(base)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["uid"] == agent_uid, seen
        assert seen["state"] == "got ['jobs']" and seen["token"].startswith("refused"), seen
        assert seen["agent's files"] == "refused: Read-only file system", seen
        assert seen["own run"] == "got 1" and seen["own home"] == "got 1", seen
        assert seen["unmount the cover"].startswith("refused"), seen
        assert seen["dumpable"] == 0, seen
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


CONFIG = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from agent.settings import parse_config
    config = parse_config(["--portal", "http://127.0.0.1:1", "--isolation", sys.argv[2]], {"BUNGEE_AGENT_TOKEN": "t"})
    print("isolation:", config.isolation)
""")


@needs_root
@pytest.mark.parametrize(("asked", "rc", "said"), [
    ("uid", 2, "--isolation uid cannot confine jobs on this machine: unshare: unshare failed: Operation not permitted"),
    ("auto", 0, "jobs run as the agent's user and see what it sees: confining them (uid) does not work here"),
    ("none", 0, ""),
])
def test_an_agent_that_cannot_confine_jobs_says_so(asked: str, rc: int, said: str) -> None:
    """Root without CAP_SYS_ADMIN (a container's root) may not make a mount namespace: asked for
    uid, the agent refuses to start and says why; on auto it runs its jobs unconfined and warns."""
    done = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c",
                           CONFIG, PROJECT, asked], capture_output=True, text=True, timeout=60)
    assert done.returncode == rc, done.stderr
    assert said in done.stderr
    if rc == 0:
        assert done.stdout.strip() == "isolation: none"
    full = subprocess.run([sys.executable, "-c", CONFIG, PROJECT, "auto"], capture_output=True, text=True, timeout=60)
    assert full.stdout.strip() == "isolation: uid", full.stderr
