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

_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_REMOUNT = 32
_PR_SET_NO_NEW_PRIVS = 38


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

    def to_json(self) -> str:
        return json.dumps({"uid": self.uid, "gid": self.gid, "home": self.home, "tmp": self.tmp,
                           "hide": list(self.hide), "keep": list(self.keep), "reach": list(self.reach)})

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        """Raises ConfinementError for anything but the fields above with their types."""
        try:
            raw = json.loads(text)
            made = cls(int(raw["uid"]), int(raw["gid"]), str(raw["home"]), str(raw["tmp"]),
                       tuple(map(str, raw.get("hide", ()))), tuple(map(str, raw.get("keep", ()))),
                       tuple(map(str, raw.get("reach", ()))))
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


def _cover(libc: ctypes.CDLL, directory: str, bring_back: Sequence[str], source: str | None = None) -> None:
    """Covers `directory` with an empty tmpfs (read-only), or with directory `source` (writable),
    and binds each of `bring_back` (paths below `directory`, as they were) back in place: what else
    the directory held is out of sight."""
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
    if source is None:  # the job cannot add to it (what is bound back keeps its own mode)
        _mount(libc, None, directory, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _below(path: str, directory: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(directory).rstrip(os.sep) + os.sep)


def confine(confinement: Confinement) -> None:
    """Confines this process as the module's docstring says. A process already running as the
    confinement's uid is left as it is (confined earlier in its life). Raises ConfinementError."""
    if os.geteuid() == confinement.uid:
        return
    if os.geteuid() != 0:
        raise ConfinementError(f"only root may confine a process to uid {confinement.uid} (this is uid {os.geteuid()})")
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWNS), "unshare a mount namespace")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    try:  # taken before anything is covered: the directory may lie where nothing else is kept
        tmp = os.open(confinement.tmp, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ConfinementError(f"the private /tmp {confinement.tmp}: {err.strerror}") from None
    needed = [*confinement.reach, *confinement.keep, confinement.home]
    for hidden in confinement.hide:
        if os.path.isdir(hidden):
            _cover(libc, hidden, [k for k in needed if _below(k, hidden)])
        elif os.path.exists(hidden):  # a file: the token file
            _mount(libc, os.devnull, hidden, None, _MS_BIND)
    covered: dict[str, list[str]] = {}
    for path in needed:
        ancestor = _blocking_ancestor(path)
        if ancestor is not None and not _below(ancestor, "/tmp") and ancestor != "/tmp":
            covered.setdefault(ancestor, []).append(path)
    for ancestor in sorted(covered, key=len):
        _cover(libc, ancestor, covered[ancestor])
    # A private /tmp: the job's own directory, with what the job needs from the real /tmp (a
    # checkout or a state directory there) bound back in place.
    _cover(libc, "/tmp", [p for p in needed if _below(p, "/tmp")], source=f"/proc/self/fd/{tmp}")
    os.close(tmp)
    os.setgroups([])
    os.setresgid(confinement.gid, confinement.gid, confinement.gid)
    os.setresuid(confinement.uid, confinement.uid, confinement.uid)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    os.environ["HOME"] = confinement.home
    os.environ.pop("TMPDIR", None)
    os.chdir(confinement.home)


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
