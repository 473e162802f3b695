"""Where a job's requirements may fetch packages from: a direct reference (`name @ URL`) only to
a host over https, http, git+https or git+ssh, and an index option (where the operator allows
them) only to an https or http URL. Every local path and every other scheme is refused with the
file and line named: at upload by the portal, and again by the agent before it builds, through
the same function of elastic.requirements (building a directory of the node's disk ran its build
backend on the node)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agent.environments import BuildFailed, Environments, EnvironmentSettings
from elastic.requirements import Declared, RequirementsError, declared_in, declared_in_directory
from tests.code_support import upload_code

LOCAL = [
    "mylib @ /home/me/mylib",
    "mylib @ ../mylib",
    "mylib @ ./mylib",
    "mylib @ ~/mylib",
    "mylib @ C:\\mylib",
    "mylib @ hg+file:///srv/mylib",
    "mylib @ svn+file:///srv/mylib",
    "mylib @ git+file:///srv/mylib",
    "mylib @ file:///srv/mylib",
    "mylib @ https:///srv/mylib",
    "mylib @ //srv/mylib",
    "mylib @ ftp://example.org/mylib-1.0.tar.gz",
    "mylib @ git+https://example.org/mylib.git#subdirectory=../../srv",
    "mylib @ https://example.org/${HOME}/mylib-1.0.tar.gz",
]
TAKEN = [
    "mylib @ https://example.org/mylib-1.0-py3-none-any.whl",
    "mylib @ http://wheels.lab.example/mylib-1.0.tar.gz",
    "mylib @ git+https://example.org/me/mylib.git@v1.0#subdirectory=python",
    "mylib @ git+ssh://git@example.org/me/mylib.git@v1.0",
    "einops[extra]>=0.8 ; python_version >= '3.8'",
]


@pytest.fixture(autouse=True)
def code_dir(settings: Any, tmp_path: Path) -> Path:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    return tmp_path / "code"


def upload(token: str, files: dict[str, bytes]) -> Any:
    return upload_code(token, files)


@pytest.mark.django_db
@pytest.mark.parametrize("line", LOCAL)
def test_a_local_path_or_another_scheme_is_400_naming_the_line(tokens: dict, code_dir: Path, line: str) -> None:
    reply = upload(tokens["alice"], {"requirements.txt": f"einops\n{line}\n".encode()})
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert error["code"] == "invalid_requirements" and "requirements.txt line 2" in error["message"], error
    assert list(code_dir.glob("*.tar.gz")) == []
    in_pyproject = f'[project]\nname = "mine"\ndependencies = ["einops", {line!r}]\n'.replace("'", '"').replace("\\", "\\\\")
    reply = upload(tokens["alice"], {"pyproject.toml": in_pyproject.encode()})
    assert reply.status_code == 400 and "pyproject.toml dependencies[1]" in reply.json()["error"]["message"], reply.content


@pytest.mark.django_db
@pytest.mark.parametrize("line", TAKEN)
def test_a_url_to_a_host_is_taken(tokens: dict, line: str) -> None:
    assert upload(tokens["alice"], {"requirements.txt": f"{line}\n".encode()}).status_code == 201


@pytest.mark.django_db
@pytest.mark.parametrize(
    "line",
    ["--find-links /srv/wheels", "-f ./wheels", "--find-links=file:///srv/wheels", "--index-url ../simple",
     "--extra-index-url https://a.example/simple https://b.example/simple", "--no-index ./wheels",
     "--index-url https://${HOME}.example/simple"],
)
def test_an_index_option_to_a_local_path_is_400_where_the_operator_allows_index_options(
    tokens: dict, settings: Any, line: str
) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"env_index_options": True})
    reply = upload(tokens["alice"], {"requirements.txt": f"{line}\neinops\n".encode()})
    assert reply.status_code == 400 and "requirements.txt line 1" in reply.json()["error"]["message"], reply.content
    taken = upload(tokens["alice"], {"requirements.txt": b"--no-index\n--find-links=https://wheels.example/\neinops\n"})
    assert taken.status_code == 201, taken.content


@pytest.mark.parametrize("line", LOCAL)
def test_the_agent_refuses_the_same_lines_before_it_builds(tmp_path: Path, line: str) -> None:
    (tmp_path / "requirements.txt").write_text(f"einops\n{line}\n")
    with pytest.raises(RequirementsError, match="requirements.txt line 2"):
        declared_in_directory(tmp_path)
    # Requirements that did not come through declared_in never reach uv either: the cache checks
    # them again (its uv, which would fail otherwise, is never run).
    parsed = declared_in({"requirements.txt": b"mylib @ https://example.org/mylib-1.0.tar.gz\n"})
    assert parsed is not None
    smuggled = Declared(parsed.source, ((parsed.requirements[0][0], type(parsed.requirements[0][1])(line)),))
    cache = Environments(EnvironmentSettings(root=tmp_path / "envs", python=sys.executable, uv="/nonexistent/uv"), {})
    with pytest.raises(BuildFailed, match="the job's requirements are refused"):
        cache.ensure(smuggled)
    assert not (tmp_path / "envs").exists()
