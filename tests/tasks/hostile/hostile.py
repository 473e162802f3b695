"""The rings task with a stranger's curiosity: before it builds its model, it tries to reach what a
job must never reach on its node, and prints one line, PROBE followed by JSON, saying what it got.
Then it trains as the rings task does. Written only for the tests."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from task import RingsTask

MARKER = "/tmp/bungee-outside-marker"
"""A file the test makes in the machine's /tmp: a job with a private /tmp does not see it."""


def _agents() -> list[tuple[int, list[str]]]:
    """The agents' pids and command lines (cmdline is readable by anyone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "-m" in argv and "agent" in argv:
            found.append((int(entry.name), argv))
    return found


def _attempt(what: Any) -> str:
    """'got N bytes' / 'listed [...]' if `what()` succeeded, else the error's name."""
    try:
        result = what()
    except (OSError, ValueError) as err:
        return f"refused: {type(err).__name__}"
    if isinstance(result, bytes | str):
        return f"got {len(result)} bytes"
    return f"listed {sorted(result)[:20]}"


def probe() -> dict[str, Any]:
    report: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
    agents = _agents()
    report["agents_seen"] = len(agents)
    token = ""
    for pid, argv in agents:
        report[f"agent {pid} environ"] = _attempt(lambda p=pid: Path(f"/proc/{p}/environ").read_bytes())
        report[f"agent {pid} mem"] = _attempt(lambda p=pid: open(f"/proc/{p}/mem", "rb").read(1))
        report[f"agent {pid} signal"] = _attempt(lambda p=pid: os.kill(p, signal.SIGCONT) or "")
        if "--token-file" in argv:
            token_file = argv[argv.index("--token-file") + 1]
            token = _attempt(lambda f=token_file: Path(f).read_text().strip() or (_ for _ in ()).throw(ValueError("empty")))
            report["token file"] = token
    readable_environs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"BUNGEE_AGENT_TOKEN" in (entry / "environ").read_bytes():
                    readable_environs.append(int(entry.name))
            except OSError:
                pass
    report["environs holding the token variable"] = readable_environs
    data_dir = os.environ.get("BUNGEE_DATA_DIR", "")
    config = json.loads(os.environ.get("BUNGEE_WORKER_CONFIG", "{}"))
    state_dir = Path(config["code_dir"]).parents[2]  # STATE/jobs/job-N/code: its own, the rest is not
    report["state dir"] = _attempt(lambda: os.listdir(state_dir))
    report["workers' records"] = _attempt(lambda: os.listdir(state_dir / "workers"))
    report["data dir"] = _attempt(lambda: os.listdir(data_dir))
    own = config.get("job_id")
    report["job id"] = own
    report["other jobs' code read"] = [
        job for job in range(1, 40) if job != own and os.path.isdir(state_dir / "jobs" / f"job-{job}" / "code")
    ]
    report["own code"] = _attempt(lambda: os.listdir(state_dir / "jobs" / f"job-{own}" / "code"))
    report["outside /tmp marker"] = _attempt(lambda: Path(MARKER).read_text())
    report["own /tmp"] = _attempt(lambda: Path("/tmp/mine").write_text("x") and Path("/tmp/mine").read_text())
    return report


class HostileRings(RingsTask):
    def __init__(self, hyperparameters: Any) -> None:
        super().__init__(hyperparameters)
        print("PROBE " + json.dumps(probe()), flush=True)
        sys.stdout.flush()
