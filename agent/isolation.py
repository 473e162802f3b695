"""What keeps a job's code away from the platform on this node (docs/operator/security.md).

Always: the agent (and the fork server, and a standby until it is a job's) is not dumpable, so
no process of its uid without CAP_SYS_PTRACE reads its memory or its /proc entries (its
environment, which may hold the token). Where jobs are confined (elastic.worker.confine), each
job's processes get a mount namespace in which the agent's state directory, its data directory,
other jobs' run directories and the token file are out of sight, and a private /tmp; as a uid and
gid of the job's own where the agent runs as root, else in user namespaces of their own, on a
machine read-only to them. JobIsolation says, for one job, what that confinement is, and makes the
job's directories for it; job_files reads what a job hands over without trusting its paths.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from elastic.worker.confine import Confinement, make_undumpable

__all__ = ["make_undumpable"]  # the agent's, from the runtime: the fork server's too

JOB_UID_COUNT = 1 << 20
"""How many uids jobs take, from the base on (a job's is the base plus its id modulo this)."""


def interpreter_paths(python: str) -> set[str]:
    """The directories interpreter `python` needs to run: its environment (a virtualenv's
    directory), the agent's, and the installation both are made from."""
    return {str(Path(python).parent.parent), sys.prefix, str(Path(sys.base_prefix).resolve())}


@dataclass(frozen=True)
class JobIsolation:
    """How this node confines jobs: job N runs as uid and gid `uid_base + N % uid_count` (where
    the agent is root; `unprivileged`: as the agent's, in user namespaces of its own), with the
    paths of `hide` out of its sight (the agent's state and data directories, its token file)."""

    uid_base: int
    uid_count: int
    hide: tuple[str, ...]
    unprivileged: bool = False

    def uid(self, job_id: int) -> int:
        return os.geteuid() if self.unprivileged else self.uid_base + job_id % self.uid_count

    @property
    def builder_uid(self) -> int:
        """The uid environments are built as (their packages' build backends are strangers' code
        too); the one below the jobs' (the agent's own where it is not root)."""
        return os.geteuid() if self.unprivileged else self.uid_base - 1

    def _gid(self, uid: int) -> int:
        return os.getegid() if self.unprivileged else uid

    def build_confinement(self, root: Path, building: Path, writable: Iterable[Path], reach: Iterable[str]) -> Confinement:
        """The confinement of a build into `building` under the environments' `root`: as
        builder_uid, which may write `building` and `writable` (made if need be, and given to it)
        and read `reach`, with a home and a /tmp of its own under ROOT/builder. Raises OSError."""
        uid = self.builder_uid
        home, tmp = root / "builder" / "home", root / "builder" / f"tmp-{building.name}"
        (root / "builder").mkdir(parents=True, exist_ok=True)
        for directory in (home, tmp, building, *writable):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.unprivileged:
                _give(directory, uid)
        return Confinement(uid=uid, gid=self._gid(uid), home=str(home), tmp=str(tmp), hide=self.hide,
                           keep=(str(home), str(building), *map(str, writable)), reach=tuple(sorted(set(reach))),
                           unprivileged=self.unprivileged)

    def confinement(self, job_id: int, state_dir: Path, run_dir: str, reach: Iterable[str]) -> Confinement:
        """Job `job_id`'s confinement on this node, its directories made: STATE_DIR/jobs/job-N
        (the agent's: its code, which the job reads) holding `home` and `tmp` (the job's own),
        and `run_dir` (the job's, where it writes its checkpoint). `reach`: what its processes
        run from (interpreter_paths, the project). Raises OSError."""
        uid = self.uid(job_id)
        job_dir = state_dir / "jobs" / f"job-{job_id}"
        job_dir.mkdir(parents=True, exist_ok=True)
        own = [job_dir / "home", job_dir / "tmp", Path(run_dir)]
        for directory in own:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if directory.is_symlink():  # made by the job's code: never followed as root
                raise OSError(f"{directory} is a link")
            os.chown(directory, uid, self._gid(uid), follow_symlinks=False)
            os.chmod(directory, 0o700)
        hide = (*self.hide, str(Path(run_dir).parent))
        return Confinement(
            uid=uid, gid=self._gid(uid), home=str(job_dir / "home"), tmp=str(job_dir / "tmp"),
            hide=hide, keep=(str(job_dir), run_dir), reach=tuple(sorted(set(reach))), unprivileged=self.unprivileged,
        )


    def worker_output(self, job_id: int, state_dir: Path, output: Path) -> Path:
        """Where a process of job `job_id` that is confined already (a standby prepared for it)
        opens its worker's output file `output` (made by the agent under its state directory,
        out of the job's sight): a link to it in the job's own directory. The file becomes the
        job's uid's. Raises OSError."""
        uid = self.uid(job_id)
        directory = state_dir / "jobs" / f"job-{job_id}" / "output"
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        link = directory / output.name
        link.unlink(missing_ok=True)
        os.link(output, link)
        os.chown(output, uid, self._gid(uid), follow_symlinks=False)
        os.chmod(output, 0o600)
        return link


def _give(directory: Path, uid: int) -> None:
    """Makes `directory` and what it holds belong to `uid` (links themselves, never followed)."""
    for parent, directories, files in os.walk(directory):
        for name in (*directories, *files):
            os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)
    os.chown(directory, uid, uid, follow_symlinks=False)


def confinement_works(unprivileged: bool) -> str | None:
    """None if this process may confine jobs as agent.isolation does (`unprivileged`: in a user
    namespace of its own), else why not: a container without CAP_SYS_ADMIN, a seccomp profile or a
    kernel that refuses user namespaces. Tried in a throwaway process: a mount namespace with a
    tmpfs mounted in it."""
    try_it = ["unshare", *(["--user", "--map-current-user"] if unprivileged else []), "--mount", "--propagation",
              "private", "mount", "-t", "tmpfs", "bungee-probe", "/tmp"]
    try:
        done = subprocess.run(try_it, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{' '.join(try_it[:3])} could not run: {err}"
    return None if done.returncode == 0 else (done.stderr.strip() or f"{try_it[0]} exited {done.returncode}")


def take_back(directory: Path) -> None:
    """Makes `directory` and what it holds the agent's, writable by it alone and readable by all,
    so that no job's process may change it (an environment that was built as the builder).
    Raises OSError."""
    _give(directory, os.geteuid())
    os.chmod(directory, 0o755)  # made private to the builder while it built; every job may read it now
    for parent, directories, files in os.walk(directory):
        for name in (*directories, *files):
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o022:
                os.chmod(path, stat.S_IMODE(mode) & ~0o022)


class ForeignFileError(Exception):
    """A file a job handed over is not one the job wrote: the message says why."""


def _directory_without_links(directory: Path) -> int:
    """A descriptor of `directory`, opened a part at a time so that no part of it is a link.
    Raises ForeignFileError, or OSError."""
    if not directory.is_absolute():
        raise ForeignFileError(f"{directory} is not an absolute path")
    descriptor = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in directory.parts[1:]:
            try:
                inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=descriptor)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ForeignFileError(f"{directory}: {part} is a link or not a directory") from None
                raise
            os.close(descriptor)
            descriptor = inner
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


@contextmanager
def job_files(directory: Path, names: Iterable[str], owner: int | None) -> Iterator[dict[str, Path]]:
    """The job's files `names` in `directory` (which the job's code named), opened for the agent,
    which may read what the job may not: no part of the path may be a link, each file must be a
    regular file and, where `owner` is given, belong to that uid (the job's). Yields name -> a path
    to the file as opened (/proc/self/fd/N), so that nothing the job does after the check changes
    what is read. Raises ForeignFileError, or OSError if a file cannot be opened."""
    opened: dict[str, int] = {}
    parent = _directory_without_links(directory)
    try:
        for name in names:
            path = directory / name
            try:
                descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
            except OSError as err:
                if err.errno == errno.ELOOP:  # the file itself is a link
                    raise ForeignFileError(f"{path} is a link") from None
                raise
            opened[name] = descriptor
            found = os.fstat(descriptor)
            if not stat.S_ISREG(found.st_mode):
                raise ForeignFileError(f"{path} is not a regular file")
            if owner is not None and found.st_uid != owner:
                raise ForeignFileError(f"{path} belongs to uid {found.st_uid}, not the job's {owner}")
        yield {name: Path(f"/proc/self/fd/{descriptor}") for name, descriptor in opened.items()}
    finally:
        for descriptor in opened.values():
            os.close(descriptor)
        os.close(parent)
