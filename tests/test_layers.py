"""The layers of docs/design/processes.md, kept by import-linter's contracts (pyproject.toml,
[tool.importlinter]): elastic/ imports neither Django, the portal nor the agent; the agent never
imports Django or the portal; the portal never imports the agent; inside the portal, scheduling
-> jobs -> cluster; live updates go out through a broadcast module that imports no app. And the
code speaks of itself: no "issue N" or "defect N" in the tree."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_every_layer_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in result.stdout, result.stdout[-2000:]


def test_a_crossing_import_breaks_its_contract(tmp_path: Path) -> None:
    """The contracts are live: the same configuration over a copy of the packages in which the
    agent imports the portal, and elastic/ Django, reports both broken."""
    for package in ("elastic", "agent", "portal"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "agent" / "crossing.py").write_text("import portal.jobs.models\n")
    (tmp_path / "elastic" / "crossing.py").write_text("from django.db import models\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "agent.crossing -> portal.jobs.models" in result.stdout, result.stdout[-3000:]
    assert "elastic.crossing -> django" in result.stdout, result.stdout[-3000:]
    assert "Contracts: 4 kept, 2 broken." in result.stdout, result.stdout[-2000:]


ISSUE_REFERENCE = re.compile(r"\b(issue|defect)s? #?\d+\b", re.IGNORECASE)


def test_the_code_speaks_of_itself_not_of_issue_numbers() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in tracked.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".png", ".svg", ".ico", ".whl", ".pt", ".gz"}:
            continue
        text = path.read_text(errors="replace")
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in ISSUE_REFERENCE.finditer(text)]
    assert not found, "\n".join(found[:50])
