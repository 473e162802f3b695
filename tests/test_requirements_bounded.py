"""A job's requirements files are bounded, and the portal checks the file a node builds from: a
requirements.txt or pyproject.toml over elastic.requirements.MAX_FILE_BYTES is refused at upload
naming the file and the bound (it was skipped unchecked, and a clean pyproject.toml beside a big
requirements.txt was checked in its place); a line, a name and the number of lines have bounds
too, and a refusal quotes a cut of the line, never the whole of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic.requirements import (
    MAX_FILE_BYTES,
    MAX_LINE_CHARS,
    MAX_LINES,
    MAX_NAME_CHARS,
    PYPROJECT_FILE,
    REQUIREMENTS_FILE,
    RequirementsError,
    declared_in_directory,
    declaring_file,
)
from tests.code_support import upload_code

pytestmark = pytest.mark.django_db

CLEAN_PYPROJECT = b'[project]\nname = "mine"\ndependencies = ["einops"]\n'
BIG_REQUIREMENTS = b"einops\n" + b"# padding\n" * (MAX_FILE_BYTES // 10) + b"mylib @ /home/me/mylib\n"


@pytest.fixture(autouse=True)
def code_dir(settings: Any, tmp_path: Path) -> Path:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    return tmp_path / "code"


def upload(token: str, files: dict[str, bytes]) -> Any:
    return upload_code(token, files)


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({REQUIREMENTS_FILE: BIG_REQUIREMENTS, PYPROJECT_FILE: CLEAN_PYPROJECT}, REQUIREMENTS_FILE),
        ({REQUIREMENTS_FILE: BIG_REQUIREMENTS}, REQUIREMENTS_FILE),
        ({PYPROJECT_FILE: CLEAN_PYPROJECT + b"# padding\n" * (MAX_FILE_BYTES // 10)}, PYPROJECT_FILE),
    ],
)
def test_a_file_over_the_bound_is_400_naming_it_and_the_bound(
    tokens: dict, code_dir: Path, files: dict[str, bytes], named: str
) -> None:
    reply = upload(tokens["alice"], files)
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert error["code"] == "invalid_requirements", error
    assert named in error["message"] and str(MAX_FILE_BYTES) in error["message"], error
    assert list(code_dir.glob("*.tar.gz")) == []


def test_the_portal_checks_the_file_the_agent_builds_from(tokens: dict, tmp_path: Path) -> None:
    files = {REQUIREMENTS_FILE: b"mylib @ /home/me/mylib\n", PYPROJECT_FILE: CLEAN_PYPROJECT}
    assert declaring_file(files) == REQUIREMENTS_FILE
    reply = upload(tokens["alice"], files)
    assert reply.status_code == 400 and f"{REQUIREMENTS_FILE} line 1" in reply.json()["error"]["message"]
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(RequirementsError, match=f"{REQUIREMENTS_FILE} line 1"):
        declared_in_directory(tmp_path)
    (tmp_path / REQUIREMENTS_FILE).write_bytes(BIG_REQUIREMENTS)
    with pytest.raises(RequirementsError, match=f"at most {MAX_FILE_BYTES} bytes"):
        declared_in_directory(tmp_path)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"einops\n" + b"a" * 1_000_000 + b"\n", f"longer than {MAX_LINE_CHARS} characters"),
        (b"einops\n" + b"a" * 2_000 + b" \\\n" + b"b" * 2_000 + b" \\\n" + b"c" * 2_000 + b"\n",
         f"longer than {MAX_LINE_CHARS} characters"),
        (b"einops\n" + b"a" * (MAX_NAME_CHARS + 1) + b">=1\n", f"at most {MAX_NAME_CHARS}"),
        (b"einops\n" + b"\n" * MAX_LINES, f"more than {MAX_LINES} lines"),
    ],
)
def test_a_long_name_line_or_file_is_400_quoting_a_cut_of_it(tokens: dict, content: bytes, said: str) -> None:
    reply = upload(tokens["alice"], {REQUIREMENTS_FILE: content})
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert said in error["message"], error
    assert len(reply.content) < 4_000, "the refusal quotes a cut of the line"
    long_name = f'[project]\nname = "mine"\ndependencies = ["{"a" * 1_000_000}"]\n'.encode()
    reply = upload(tokens["alice"], {PYPROJECT_FILE: long_name})
    assert reply.status_code == 400 and "pyproject.toml dependencies[0]" in reply.json()["error"]["message"]
    assert len(reply.content) < 4_000


def test_names_and_lines_within_the_bounds_are_taken(tokens: dict) -> None:
    content = b"a" * MAX_NAME_CHARS + b"\n" + b"# a comment\n" * (MAX_LINES - 1)
    assert upload(tokens["alice"], {REQUIREMENTS_FILE: content}).status_code == 201
