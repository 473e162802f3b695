"""The import check of a new environment (agent.environments): after uv installed a job's
packages, each of them that requires torch is imported beside the node's torch, and one that
fails (a package built for another torch: it resolves, installs, and raises at import) fails the
build with a message that names it, the node's torch build and what to do; the environment is not
kept. Built with uv, offline, from wheels this test writes, and, where this machine's pip can get
it, from PyPI's torchvision, which fails beside a CPU torch exactly so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.environments import TORCH_PACKAGES_DOC, BuildFailed
from tests.environment_support import write_wheel
from tests.test_agent_environments import declared, environments, run_in
from tests.test_environment_build_confinement import UID_BASE, confined

NODE_TORCH = f"torch {torch.__version__} ({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU'} build)"

FOREIGN_EXTENSION = (
    "import torch\n"
    "raise RuntimeError('operator torchforeign::nms does not exist')\n"
)
"""What an extension built against another torch does at import: its operators fail to register."""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheelhouse = tmp_path_factory.mktemp("wheelhouse")
    write_wheel(wheelhouse, "torchforeign", "0.1", requires=("torch>=2", "numpy"), code=FOREIGN_EXTENSION)
    write_wheel(wheelhouse, "torchfriend", "1.0", requires=("torch",), code="import torch\nONES = torch.ones(2)")
    write_wheel(wheelhouse, "torchcrash", "1.0", requires=("torch",), code="import os, torch\nos.abort()",
                top_level=True)
    write_wheel(wheelhouse, "torchoptional", "1.0", requires=("torch; extra == 'gpu'",),
                code="raise ImportError('needs a display')")
    write_wheel(wheelhouse, "notorch", "1.0", code="raise ImportError('only a torch package is imported')")
    return wheelhouse


def test_a_package_that_does_not_import_beside_the_node_torch_fails_the_build(
    tmp_path: Path, wheelhouse: Path
) -> None:
    cache = environments(tmp_path, wheelhouse)
    for _ in range(2):  # the failed build was not kept: the second try builds, and fails, again
        with pytest.raises(BuildFailed) as failed:
            cache.ensure(declared("torchfriend==1.0\ntorchforeign==0.1\n"))
        message = str(failed.value)
        assert message.startswith(f"package torchforeign 0.1 installed but does not import beside this node's "
                                  f"{NODE_TORCH}: import torchforeign raised RuntimeError: operator "
                                  "torchforeign::nms does not exist"), message
        for what_to_do in ("--env-find-links", "BUNGEE_ENV_FIND_LINKS", "--env-index-options", TORCH_PACKAGES_DOC):
            assert what_to_do in message
        assert not list(cache.root.glob("envs/*")) and not list(cache.root.glob("tmp-*")), "nothing is kept"


def test_an_import_that_ends_the_interpreter_names_the_package(tmp_path: Path, wheelhouse: Path) -> None:
    with pytest.raises(BuildFailed, match=r"^package torchcrash 1.0 installed but does not import beside .* "
                                          r"raised an error that ended the interpreter"):
        environments(tmp_path, wheelhouse).ensure(declared("torchcrash==1.0\n"))
    assert not list(tmp_path.glob("envs/*"))


def test_only_packages_that_require_torch_are_imported(tmp_path: Path, wheelhouse: Path) -> None:
    """torchfriend imports torch and passes (its module found from its RECORD); notorch and
    torchoptional (torch only with an extra) would raise, but are not imported."""
    built = environments(tmp_path, wheelhouse).ensure(declared("torchfriend==1.0\nnotorch==1.0\ntorchoptional==1.0\n"))
    assert built.built_s is not None
    assert run_in(built.path, "import torchfriend; print(torchfriend.ONES.sum().item())") == "2.0"


def pypi_torchvision(directory: Path) -> Path | None:
    """PyPI's torchvision wheel for this torch, if this machine's pip can get it; None otherwise."""
    version = {"2.13": "0.28.0"}.get(".".join(torch.__version__.split(".")[:2]))
    if version is None:
        return None
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           f"torchvision=={version}", "-d", str(directory)], capture_output=True, timeout=300)
    found = list(directory.glob("torchvision-*.whl"))
    return found[0] if done.returncode == 0 and found else None


@pytest.mark.skipif(torch.version.cuda is not None, reason="PyPI's torchvision matches a CUDA torch")
def test_pypi_torchvision_beside_a_cpu_torch_fails_the_build(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    wheel = pypi_torchvision(wheelhouse)
    if wheel is None:
        pytest.skip("no torchvision wheel reachable from this machine's pip")
    with pytest.raises(BuildFailed, match=r"^package torchvision \S+ installed but does not import beside this "
                                          rf"node's {NODE_TORCH.replace('+', '.').replace('(', '.').replace(')', '.')}"
                                          r": import torchvision raised RuntimeError: operator torchvision::nms "
                                          r"does not exist"):
        environments(tmp_path / "environments", wheelhouse).ensure(declared("torchvision\n"))
    assert not list((tmp_path / "environments").glob("envs/*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="confined builds need an agent running as root")
def test_the_check_runs_confined_as_the_build(tmp_path: Path) -> None:
    """The check imports a stranger's package: it runs as the builder's uid, as uv did, and sees
    not the agent's token file."""
    token = tmp_path / "token"
    token.write_text("secret")
    wheelhouse = tmp_path / "wheelhouse"
    write_wheel(wheelhouse, "torchnosy", "1.0", requires=("torch",), code=(
        "import os, torch\n"
        f"try:\n    seen = open({str(token)!r}).read()\nexcept OSError as err:\n    seen = type(err).__name__\n"
        "raise RuntimeError(f'uid {os.getuid()} token {seen}')"
    ))
    cache = confined(tmp_path / "environments", wheelhouse, (str(token),))
    with pytest.raises(BuildFailed, match=rf"raised RuntimeError: uid {UID_BASE - 1} token "
                                          r"(PermissionError|FileNotFoundError)\."):
        cache.ensure(declared("torchnosy==1.0\n"))


def test_an_import_that_hangs_is_stopped_at_the_builds_deadline_naming_the_package(tmp_path: Path) -> None:
    """The deadline leaves the install and torch's import ample time (a build that imports torch
    took at most 12.4 s at load 8.6 on the 2-core VM, bench/RESULTS.md); the package's own import
    never ends."""
    wheelhouse = tmp_path / "wheelhouse"
    write_wheel(wheelhouse, "torchhang", "1.0", requires=("torch",), code="import time, torch\ntime.sleep(600)")
    cache = environments(tmp_path / "environments", wheelhouse, build_deadline_s=40.0)
    with pytest.raises(BuildFailed, match=r"took over 40 s, its deadline \(--env-build-deadline .*\); it was stopped, "
                                          r"importing package torchhang 1.0 \(import torchhang\) beside this node's torch"):
        cache.ensure(declared("torchhang==1.0\n"))
    assert not list(cache.root.glob("envs/*")) and not list(cache.root.glob("tmp-*"))
