"""Jobs' own environments on a node (agent.environments), built with uv from a wheelhouse this
test writes, offline: layered over the node's packages (torch comes from the node), built once
per digest and then found in the cache, a resolver error told in uv's words, a build killed half
way leaving nothing in the cache, LRU eviction that spares what is in use, and a build that sees
neither the agent's token nor anything else of its environment it does not need."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.environments import (
    SIZE_FILE,
    BuildFailed,
    Environments,
    EnvironmentSettings,
    build_environment,
    uv_binary,
)
from elastic.requirements import RequirementsError, declared_in
from elastic.wire import OWN_PACKAGES_FILE
from tests.environment_support import TINY, tiny_wheelhouse

OFFLINE = {"PATH": os.defpath, "UV_OFFLINE": "1"}


def declared(text: str):  # type: ignore[no-untyped-def]
    found = declared_in({"requirements.txt": text.encode()})
    assert found is not None
    return found


def environments(root: Path, wheelhouse: Path, uv: str | None = None, **settings: object) -> Environments:
    return Environments(
        EnvironmentSettings(root=root, python=sys.executable, uv=uv or uv_binary(), find_links=(str(wheelhouse),),
                            **settings),  # type: ignore[arg-type]
        OFFLINE,
    )


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Iterator[tuple[Environments, Path]]:
    root = tmp_path_factory.mktemp("environments")
    cache = environments(root, wheelhouse)
    environment = cache.ensure(declared(f"{TINY}==2.0\n"))
    assert environment.built_s is not None
    yield cache, environment.path


def run_in(environment: Path, code: str) -> str:
    done = subprocess.run([str(environment / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          check=True, env={"PATH": os.defpath})
    return done.stdout.strip()


def test_the_environment_has_the_job_package_and_the_node_torch(built: tuple[Environments, Path]) -> None:
    _, path = built
    found = run_in(path, f"import importlib.util, {TINY}; print({TINY}.VERSION, {TINY}.__file__, "
                         "importlib.util.find_spec('torch').origin)").split()
    version, package, torch_from = found
    assert version == "2.0" and package.startswith(str(path))
    node_torch = importlib.util.find_spec("torch").origin  # type: ignore[union-attr]
    assert torch_from == node_torch, "torch is imported from the node's site-packages, never installed again"
    assert not list(path.rglob("torch")), "no copy of torch in the environment"
    assert not list(path.rglob("*.dist-info/INSTALLER")) or all(
        "placeholder" not in p.read_text() for p in path.rglob("*.dist-info/INSTALLER")
    ), "the node's placeholders are gone"


def test_the_environment_records_its_own_packages_for_its_workers(built: tuple[Environments, Path]) -> None:
    """What the job's manifest and the portal learn: the requirements as given and every package
    installed in the environment (numpy, which TINY 2.0 needs, is the node's: not among them)."""
    cache, path = built
    found = cache.ensure(declared(f"{TINY}==2.0\n"))
    own = found.own_packages()
    assert own is not None and own.digest == found.digest == path.name
    assert (own.source, own.requirements, own.packages, own.left_out) == ("requirements.txt", [f"{TINY}==2.0"],
                                                                          {TINY: "2.0"}, 0)
    assert run_in(path, f"import sys, pathlib; print(pathlib.Path(sys.prefix, {OWN_PACKAGES_FILE!r}).is_file())") \
        == "True", "a worker finds it at its interpreter's prefix"


def test_the_same_requirements_are_found_in_the_cache_by_any_agent(
    built: tuple[Environments, Path], wheelhouse: Path
) -> None:
    cache, path = built
    again = cache.ensure(declared(f"# the same, written otherwise\n{TINY} == 2.0\n"))
    assert again.built_s is None and again.path == path
    restarted = environments(cache.root, wheelhouse, uv="/nonexistent/uv")  # a build would fail: none happens
    assert restarted.ensure(declared(f"{TINY}==2.0")).path == path


def test_an_unresolvable_requirement_fails_with_the_resolvers_words(
    built: tuple[Environments, Path], wheelhouse: Path
) -> None:
    cache, _ = built
    with pytest.raises(BuildFailed) as failed:
        cache.ensure(declared(f"{TINY}==3.0\n"))
    assert "No solution found when resolving dependencies" in str(failed.value)
    assert f"{TINY}==3.0" in failed.value.output or TINY in str(failed.value)
    assert not list(cache.root.glob("tmp-*")), "nothing half-built is left"
    with pytest.raises(BuildFailed, match="torch"):
        cache.ensure(declared("torch<2\n"))


def test_callers_at_once_share_one_build(tmp_path: Path, wheelhouse: Path) -> None:
    """Jobs and workers asking at the same moment (threads of one agent, or two agents on one
    root: the lock is an flock) get one build between them."""
    first, second = environments(tmp_path, wheelhouse), environments(tmp_path, wheelhouse)
    results = []
    threads = [threading.Thread(target=lambda c=cache: results.append(c.ensure(declared(f"{TINY}==1.0"))))
               for cache in (first, second, first)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len({r.path for r in results}) == 1
    assert sum(r.built_s is not None for r in results) == 1, "one built it, the others found it"


def test_a_build_killed_half_way_leaves_no_entry_and_the_next_build_succeeds(
    tmp_path: Path, wheelhouse: Path
) -> None:
    started = tmp_path / "installing"
    stalling_uv = tmp_path / "uv"
    stalling_uv.write_text(
        f"#!/bin/sh\nif [ \"$1\" = pip ]; then touch {started}; exec sleep 600; fi\nexec {uv_binary()} \"$@\"\n"
    )
    stalling_uv.chmod(0o755)
    root = tmp_path / "environments"
    code = (
        "import sys; from pathlib import Path; from tests.test_agent_environments import environments, declared; "
        f"environments(Path({str(root)!r}), Path({str(wheelhouse)!r}), uv={str(stalling_uv)!r})"
        f".ensure(declared('{TINY}==1.0'))"
    )
    agent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    deadline = time.monotonic() + 60
    while not started.exists():
        assert agent.poll() is None and time.monotonic() < deadline, "the build never reached its install"
        time.sleep(0.02)
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    assert list(root.glob("tmp-*")) and not list((root / "envs").glob("*")), "half-built, and not in the cache"
    again = environments(root, wheelhouse).ensure(declared(f"{TINY}==1.0"))
    assert again.built_s is not None and run_in(again.path, f"import {TINY}; print({TINY}.VERSION)") == "1.0"
    assert not list(root.glob("tmp-*")), "the next build of the digest removed the leftover"


def test_a_build_past_its_deadline_fails_naming_the_setting(tmp_path: Path, wheelhouse: Path) -> None:
    stalling_uv = tmp_path / "uv"
    stalling_uv.write_text("#!/bin/sh\nexec sleep 600\n")
    stalling_uv.chmod(0o755)
    cache = environments(tmp_path / "environments", wheelhouse, uv=str(stalling_uv), build_deadline_s=0.2)
    with pytest.raises(BuildFailed, match=r"took over 0 s, its deadline \(--env-build-deadline"):
        cache.ensure(declared(TINY))
    assert not list(cache.root.glob("tmp-*"))


def fake_entry(root: Path, digest: str, size: int, used_at: float) -> Path:
    path = root / "envs" / digest
    (path / "bin").mkdir(parents=True)
    (path / SIZE_FILE).write_text(str(size))
    os.utime(path, (used_at, used_at))
    return path


def test_eviction_removes_the_least_recently_used_never_one_in_use(tmp_path: Path, wheelhouse: Path) -> None:
    cache = environments(tmp_path, wheelhouse, max_bytes=250)
    oldest, running, held, newest = (fake_entry(tmp_path, name, 100, at) for name, at in
                                     (("oldest", 1), ("running", 2), ("held", 3), ("newest", 4)))
    (running / "bin" / "python").symlink_to(sys.executable)
    worker = subprocess.Popen([str(running / "bin" / "python"), "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    try:
        with cache.hold("held"):
            assert cache.evict() == ["oldest"] + ["newest"]
    finally:
        worker.communicate(b"")
    assert not oldest.exists() and not newest.exists() and running.exists() and held.exists()
    fake_entry(tmp_path, "later", 100, 5)
    assert cache.evict() == ["running"], "once its worker is gone, it may go"


def test_the_build_sees_neither_the_token_nor_the_jobs_variables() -> None:
    agent = {"PATH": "/usr/bin", "HOME": "/home/agent", "BUNGEE_AGENT_TOKEN": "secret", "BUNGEE_AGENT_TOKEN_FILE": "/t",
             "PIP_INDEX_URL": "https://pypi.lab/simple", "UV_FIND_LINKS": "/wheels", "WANDB_API_KEY": "k",
             "PYTHONPATH": "/somewhere"}
    clean = build_environment(agent)
    assert clean["UV_INDEX_URL"] == "https://pypi.lab/simple" and clean["UV_FIND_LINKS"] == "/wheels"
    assert clean["PATH"] == "/usr/bin" and clean["HOME"] == "/home/agent"
    assert not {"BUNGEE_AGENT_TOKEN", "BUNGEE_AGENT_TOKEN_FILE", "WANDB_API_KEY", "PYTHONPATH"} & set(clean)


def test_index_options_in_a_jobs_requirements_only_where_the_operator_allows_them(
    tmp_path: Path, wheelhouse: Path
) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(wheelhouse))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as served:
        threading.Thread(target=served.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{served.server_address[1]}/"
        text = f"--no-index\n--find-links={url}\n{TINY}==1.0\n"
        with pytest.raises(RequirementsError, match="unless the operator allows index options"):
            declared_in({"requirements.txt": text.encode()})
        allowed = declared_in({"requirements.txt": text.encode()}, index_options=True)
        assert allowed is not None and allowed.lines() == ["--no-index", f"--find-links {url}", f"{TINY}==1.0"]
        cache = Environments(
            EnvironmentSettings(root=tmp_path, python=sys.executable, uv=uv_binary(), index_options=True),
            {"PATH": os.defpath},
        )
        built = cache.ensure(allowed)  # the node names no wheelhouse: the job's line does
        served.shutdown()
    assert run_in(built.path, f"import {TINY}; print({TINY}.VERSION)") == "1.0"
