"""A liveness file: a process that answers no HTTP (the agent, the Celery worker, beat) touches a
file each time its main loop turns, and a probe (`python -m elastic.liveness FILE --max-age S`,
Kubernetes' exec probe) says the process is stuck when the file is older than that. Django-free
and stdlib-only, since the agent and the portal's Celery processes both use it and the probe
starts a new interpreter at every check.

The file's path is the process's BUNGEE_LIVENESS_FILE, a setting of the portal's Celery processes
(portal.config.PortalSettings) and of the agent (agent.settings.AgentSettings, `--liveness-file`);
unset (a laptop, the tests, docker-compose), nothing is written. A failure to write is logged once
and never stops the process: a stale file makes the probe fail, which is the supervisor's
business, not a reason to stop training."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class LivenessFile:
    """Touches `path` on `beat`; with `path` None, does nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._failing = False

    def start(self) -> None:
        """Removes a file an earlier run of the process left (in a volume that outlived it), so
        that the probe waits for this run's first beat."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def beat(self) -> None:
        """Sets the file's modification time to now, creating it (and its folder) if needed."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as err:
            if not self._failing:
                log.warning("cannot touch the liveness file %s (the liveness probe will fail): %s", self.path, err)
            self._failing = True
        else:
            if self._failing:
                log.info("the liveness file %s is written again", self.path)
            self._failing = False


def age_problem(path: Path, max_age_s: float, now: float | None = None) -> str | None:
    """Why `path` says its process is not alive (missing, or last touched more than `max_age_s`
    ago), or None if it was touched within `max_age_s`."""
    try:
        touched = path.stat().st_mtime
    except FileNotFoundError:
        return f"{path} does not exist: the process has not beaten since it started"
    except OSError as err:
        return f"cannot read {path}: {err.strerror}"
    age = (time.time() if now is None else now) - touched
    if age > max_age_s:
        return f"{path} was last touched {age:.0f} s ago, more than --max-age {max_age_s:g} s"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """The probe: exits 0 if FILE was touched within --max-age seconds, else 1 with the reason on
    stderr (kubelet shows it in the pod's events)."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic.liveness",
        description="Exit 0 if a liveness file was touched recently, 1 otherwise.",
    )
    parser.add_argument("file", type=Path, help="the liveness file (the process's BUNGEE_LIVENESS_FILE)")
    parser.add_argument("--max-age", type=float, required=True, help="seconds since the last touch, at most")
    args = parser.parse_args(argv)
    if args.max_age <= 0:
        parser.error(f"--max-age {args.max_age:g} must be above 0")
    problem = age_problem(args.file, args.max_age)
    if problem is not None:
        print(f"not alive: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
