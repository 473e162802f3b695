"""Confinement of a job's process on a node whose agent runs as root: before any of the job's code
runs, the process (a worker, a standby prepared for a job, an export) moves into a mount namespace
of its own and drops to the job's unprivileged uid, so that the kernel keeps it from the
platform's secrets and from other jobs.

In its own mount namespace, while still root, it:
- covers each `hide` directory (the agent's state directory: its token, its records, other jobs'
  code) with an empty tmpfs, and binds back only the `keep` paths beneath it (the job's own);
- binds the job's private directory `tmp` over /tmp (a private /tmp);
- makes each `reach` path (the interpreter, the project, the job's environment and run directory)
  reachable to the job's uid where a directory above it is closed to others (a 0700 home holding
  the interpreter): that directory is covered with a tmpfs in which only those paths are bound
  back, so the rest of it stays out of sight too.
Then it drops every group, takes the job's gid and uid (which clears its capabilities) and sets
no_new_privs. Its pid does not change (no fork), so the agent keeps supervising it as before. A
process of another uid cannot read the agent's memory or /proc entries (the agent is not
dumpable), nor signal it.

Stdlib only: `python -I -S confine.py -- ARGV` runs it before a job's own interpreter is
executed (an environment's packages may run code at start-up, through .pth files), and the
worker runtime calls `confine` in processes that were started as root from the node's own
interpreter (a fork server's child, a standby)."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CONFINEMENT_ENV = "BUNGEE_CONFINEMENT"
"""The variable that holds a process's Confinement as JSON; absent: not confined."""
CONFINED_ENV = "BUNGEE_CONFINED"
"""Set to 1 in a process once it is confined (and so in what it executes): confining is done once."""

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_PR_SET_DUMPABLE = 4
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_REMOUNT = 32
_MS_NOEXEC = 8
_KEPT_FLAGS = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
               (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
"""statvfs's flags of a mount and the mount(2) flags that keep them on a remount."""
_PR_SET_NO_NEW_PRIVS = 38


_confined = False
"""Whether this process confined itself (its environment may be replaced since: a standby's is)."""


class ConfinementError(Exception):
    """The process could not be confined; the message names the step and the path."""


@dataclass(frozen=True)
class Confinement:
    """Where and as whom a job's process runs (see the module's docstring)."""

    uid: int
    gid: int
    home: str
    tmp: str
    hide: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    reach: tuple[str, ...] = field(default_factory=tuple)
    unprivileged: bool = False
    """The agent does not run as root: the job keeps its uid (the agent's), and user namespaces
    do what a uid of its own would."""

    def to_json(self) -> str:
        return json.dumps({"uid": self.uid, "gid": self.gid, "home": self.home, "tmp": self.tmp,
                           "hide": list(self.hide), "keep": list(self.keep), "reach": list(self.reach),
                           "unprivileged": self.unprivileged})

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        """Raises ConfinementError for anything but the fields above with their types."""
        try:
            raw = json.loads(text)
            made = cls(int(raw["uid"]), int(raw["gid"]), str(raw["home"]), str(raw["tmp"]),
                       tuple(map(str, raw.get("hide", ()))), tuple(map(str, raw.get("keep", ()))),
                       tuple(map(str, raw.get("reach", ()))), bool(raw.get("unprivileged", False)))
        except (ValueError, TypeError, KeyError) as err:
            raise ConfinementError(f"a bad confinement {text[:200]!r}: {err}") from err
        if made.uid <= 0 or made.gid <= 0:
            raise ConfinementError(f"a job may not run as uid {made.uid} / gid {made.gid}: it must be unprivileged")
        return made


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise ConfinementError(f"{what}: {os.strerror(errno)}")


def _bytes(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _check(libc.mount(_bytes(source), target.encode(), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)),
           f"mount {source or fstype} on {target}")


def _closed_to_others(path: str) -> bool:
    """Whether a process of another uid and group may not pass through directory `path`."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not mode & stat.S_IXOTH


def _blocking_ancestor(path: str) -> str | None:
    """The topmost directory above `path` (or `path` itself) that others may not pass through."""
    parts = os.path.abspath(path).split(os.sep)
    for end in range(2, len(parts) + 1):
        ancestor = os.sep.join(parts[:end]) or os.sep
        if ancestor != path and _closed_to_others(ancestor):
            return ancestor
    return None


def _remount(libc: ctypes.CDLL, path: str, read_only: bool) -> None:
    """Makes the mount at `path` read-only or writable, keeping its other flags (a user
    namespace may not drop those it inherited locked)."""
    kept = os.statvfs(path).f_flag
    flags = _MS_REMOUNT | _MS_BIND | (_MS_RDONLY if read_only else 0)
    for statvfs_flag, mount_flag in _KEPT_FLAGS:
        if kept & statvfs_flag:
            flags |= mount_flag
    _mount(libc, None, path, None, flags)


def _cover(libc: ctypes.CDLL, directory: str, bring_back: Sequence[str], writable: Sequence[str],
           source: str | None = None) -> None:
    """Covers `directory` with an empty tmpfs (read-only), or with directory `source` (writable),
    and binds each of `bring_back` (paths below `directory`, as they were) back in place, writable
    if it is in `writable`, else read-only: what else the directory held is out of sight."""
    handles = []
    for path in bring_back:
        try:
            handles.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        except OSError:
            continue  # not there (yet): nothing to bring back
    if source is None:
        _mount(libc, "bungee-confined", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    else:
        _mount(libc, source, directory, None, _MS_BIND)
        _remount(libc, directory, read_only=False)
    for path, handle in handles:
        target = os.path.join(directory, os.path.relpath(path, directory))
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if stat.S_ISDIR(os.fstat(handle).st_mode):
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif not os.path.exists(target):
            with open(target, "wb"):
                pass
        _mount(libc, f"/proc/self/fd/{handle}", target, None, _MS_BIND | _MS_REC)
        os.close(handle)
        _remount(libc, target, read_only=path not in writable)
    if source is None:  # the job cannot add to it (what is bound back keeps its own mode)
        _remount(libc, directory, read_only=True)


def _read_only_everywhere(libc: ctypes.CDLL) -> None:
    """Makes every mount of this mount namespace read-only, but the kernel's (/proc, /sys, /dev
    and what is below them): a job that keeps the agent's uid writes only where it is given."""
    with open("/proc/self/mountinfo") as table:
        points = sorted({line.split()[4].replace("\\040", " ") for line in table}, key=len)
    for point in points:
        if any(point == top or point.startswith(top + "/") for top in ("/proc", "/sys", "/dev")):
            continue
        try:
            _remount(libc, point, read_only=True)
        except (ConfinementError, OSError):
            continue  # a mount hidden below another one: nothing reaches it through its path


def _below(path: str, directory: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(directory).rstrip(os.sep) + os.sep)


def _enter_user_namespace(libc: ctypes.CDLL, uid: int, gid: int) -> None:
    """Moves this process into a new user namespace and mount namespace, as the same uid and gid."""
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare a user namespace (unprivileged user namespaces off?)")
    # Its maps are written through /proc/self, which a process that is not dumpable (one that
    # changed its uid without an exec since) does not own.
    _check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "set the process dumpable")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as map_file:
            map_file.write(text)


def confine(confinement: Confinement) -> None:
    """Confines this process as the module's docstring says: as root, into the confinement's uid;
    as another user (Confinement.unprivileged), in user namespaces of its own. A process confined
    earlier in its life (CONFINED_ENV set) is left as it is. Raises ConfinementError."""
    global _confined
    if _confined or os.environ.get(CONFINED_ENV) == "1" or (
        not confinement.unprivileged and os.geteuid() == confinement.uid
    ):
        return
    libc = _libc()
    if confinement.unprivileged:
        if (os.geteuid(), os.getegid()) != (confinement.uid, confinement.gid):
            raise ConfinementError(f"uid {os.geteuid()} cannot be confined as uid {confinement.uid}: it is not its own")
        _enter_user_namespace(libc, confinement.uid, confinement.gid)
    elif os.geteuid() != 0:
        raise ConfinementError(f"only root may confine a process to uid {confinement.uid} (this is uid {os.geteuid()})")
    else:
        _check(libc.unshare(_CLONE_NEWNS), "unshare a mount namespace")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    try:  # taken before anything is covered: the directory may lie where nothing else is kept
        tmp = os.open(confinement.tmp, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ConfinementError(f"the private /tmp {confinement.tmp}: {err.strerror}") from None
    needed = [*confinement.reach, *confinement.keep, confinement.home]
    writable = [*confinement.keep, confinement.home]
    if confinement.unprivileged:
        _read_only_everywhere(libc)
    for hidden in confinement.hide:
        if os.path.isdir(hidden):
            _cover(libc, hidden, [k for k in needed if _below(k, hidden)], writable)
        elif os.path.exists(hidden):  # a file: the token file
            _mount(libc, os.devnull, hidden, None, _MS_BIND)
    if not confinement.unprivileged:  # the job's uid is not the owner of what it runs from
        covered: dict[str, list[str]] = {}
        for path in needed:
            ancestor = _blocking_ancestor(path)
            if ancestor is not None and not _below(ancestor, "/tmp") and ancestor != "/tmp":
                covered.setdefault(ancestor, []).append(path)
        for ancestor in sorted(covered, key=len):
            _cover(libc, ancestor, covered[ancestor], writable)
    # A private /tmp: the job's own directory, with what the job needs from the real /tmp (a
    # checkout or a state directory there) bound back in place.
    _cover(libc, "/tmp", [p for p in needed if _below(p, "/tmp")], writable, source=f"/proc/self/fd/{tmp}")
    os.close(tmp)
    if confinement.unprivileged:
        # A second user and mount namespace locks every mount made above: the job's code, which
        # holds capabilities in its own user namespace, cannot unmount a cover to see beneath it.
        _enter_user_namespace(libc, confinement.uid, confinement.gid)
        # Its own processes are not dumpable: a job of the same uid cannot read their memory.
        _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "set the process not dumpable")
    else:
        os.setgroups([])
        os.setresgid(confinement.gid, confinement.gid, confinement.gid)
        os.setresuid(confinement.uid, confinement.uid, confinement.uid)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    os.environ["HOME"] = confinement.home
    os.environ.pop("TMPDIR", None)
    os.environ[CONFINED_ENV] = "1"
    _confined = True
    os.chdir(confinement.home)


def make_undumpable() -> None:
    """Marks this process not dumpable: its /proc entries belong to root and only a process with
    CAP_SYS_PTRACE may read its memory, its environment or its view of the files (/proc/PID/root),
    or trace it. For the platform's own processes (the agent, the fork server, waiting standbys),
    which a job of the same uid must not reach. Raises ConfinementError."""
    _check(_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")


def confine_from_env(environ: Mapping[str, str] | None = None) -> Confinement | None:
    """Confines this process as `environ`'s CONFINEMENT_ENV says, if it says anything; returns
    the confinement. Raises ConfinementError."""
    text = (os.environ if environ is None else environ).get(CONFINEMENT_ENV)
    if not text:
        return None
    confinement = Confinement.from_json(text)
    confine(confinement)
    return confinement


def main(argv: Sequence[str]) -> Any:
    """`confine.py -- PROGRAM ARG...`: confines itself as its environment says, then executes
    PROGRAM in its place (the same pid)."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: confine.py -- PROGRAM [ARG...]", file=sys.stderr)
        return 2
    program = list(argv[argv.index("--") + 1:])
    try:
        confine_from_env()
    except ConfinementError as err:
        print(f"the job's process could not be confined: {err}", file=sys.stderr)
        return 71
    os.execv(program[0], program)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
