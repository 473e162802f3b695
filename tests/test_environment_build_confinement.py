"""Environments built confined where jobs are (agent.environments with agent.isolation): a
package's build backend is a stranger's code too. A source distribution whose in-tree backend looks
for the agent's token file, its state directory and the agent's environment, and leaves a process
behind, finds none of them, and what it left ends with the build; a build of ordinary packages still
works, and the environment it makes belongs to the agent, so no job's process may change it."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from agent.environments import BuildFailed, Environments, EnvironmentSettings, uv_binary
from agent.isolation import JOB_UID_COUNT, JobIsolation
from elastic.requirements import declared_in
from tests.environment_support import TINY, tiny_wheelhouse

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="confined builds need an agent running as root")

UID_BASE = 310_000
BACKEND = textwrap.dedent('''
    import json, os, subprocess, sys

    def _attempt(what):
        try:
            return "got " + repr(what())[:60]
        except OSError as err:
            return "refused: " + type(err).__name__

    def _probe():
        return {
            "uid": os.getuid(),
            "token": _attempt(lambda: open(TOKEN).read()),
            "state": _attempt(lambda: os.listdir(STATE)),
            "agent environ": _attempt(lambda: open("/proc/%d/environ" % AGENT, "rb").read()),
        }

    def get_requires_for_build_wheel(config_settings=None):
        return []

    def build_wheel(directory, config_settings=None, metadata_directory=None):
        # Left behind: a process in a session of its own, meant to outlive the build.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        raise RuntimeError("PROBE " + json.dumps(_probe()))
''')


def hostile_sdist(wheelhouse: Path, token: Path, state: Path) -> None:
    backend = f"TOKEN = {str(token)!r}\nSTATE = {str(state)!r}\nAGENT = {os.getpid()}\n" + BACKEND
    files = {
        "PKG-INFO": b"Metadata-Version: 2.1\nName: bungeehostile\nVersion: 1.0\n",
        "pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
                          b'[project]\nname = "bungeehostile"\nversion = "1.0"\n',
        "backend.py": backend.encode(),
    }
    with tarfile.open(wheelhouse / "bungeehostile-1.0.tar.gz", "w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(f"bungeehostile-1.0/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))


def confined(root: Path, wheelhouse: Path, hide: tuple[str, ...]) -> Environments:
    isolation = JobIsolation(UID_BASE, JOB_UID_COUNT, hide)
    settings = EnvironmentSettings(root=root, python=sys.executable, uv=uv_binary(), find_links=(str(wheelhouse),),
                                   isolation=isolation)
    return Environments(settings, {"PATH": os.defpath, "UV_OFFLINE": "1", "BUNGEE_AGENT_TOKEN": "not-for-builds"})


def declared(text: str):  # type: ignore[no-untyped-def]
    found = declared_in({"requirements.txt": text.encode()})
    assert found is not None
    return found


def builders_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == UID_BASE - 1]


def test_a_build_backend_reaches_no_secret_and_leaves_nothing_running(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "workers").mkdir(parents=True)
    token = tmp_path / "agent.token"
    token.write_text("the-token")
    wheelhouse = tiny_wheelhouse(tmp_path / "wheelhouse")
    hostile_sdist(wheelhouse, token, state)
    cache = confined(state / "environments", wheelhouse, (str(state), str(token)))
    with pytest.raises(BuildFailed) as failed:
        cache.ensure(declared("bungeehostile==1.0\n"))
    [line] = [line for line in failed.value.output.splitlines() if "RuntimeError: PROBE " in line]
    probe = json.loads(line[line.index("PROBE ") + len("PROBE "):])
    assert probe["uid"] == UID_BASE - 1, probe
    assert probe["token"] in ("got ''", "refused: FileNotFoundError"), probe
    assert probe["state"] in ("got ['environments']", "refused: FileNotFoundError"), probe
    assert probe["agent environ"] == "refused: PermissionError", probe
    deadline = time.monotonic() + 10
    while builders_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert builders_processes() == [], "what the build left ended with it"


def test_a_confined_build_makes_an_environment_only_the_agent_may_change(tmp_path: Path) -> None:
    wheelhouse = tiny_wheelhouse(tmp_path / "wheelhouse")
    root = tmp_path / "state" / "environments"
    cache = confined(root, wheelhouse, (str(tmp_path / "state"),))
    environment = cache.ensure(declared(f"{TINY}==2.0\n"))
    owners = {os.lstat(os.path.join(parent, name)).st_uid
              for parent, directories, files in os.walk(environment.path) for name in (*directories, *files)}
    assert owners == {os.geteuid()} and environment.path.stat().st_mode & 0o777 == 0o755  # every job reads it
    assert not [p for p in environment.path.rglob("*") if not p.is_symlink() and p.stat().st_mode & 0o022]
