"""Every code block of README.md and docs/ marked runnable runs as the reader would run it.

Mark a block by a second word `runnable` after its language (a code host still highlights it by
the first): ```` ```python runnable ````, ```` ```yaml runnable ````, ```` ```sh runnable ````.

- Python: written to the file its first line names in a comment (`# mytask/task.py`; else
  `task/task.py`). Each task class in it (one that defines model, optimizer, train_data and
  loss) is loaded by the task runtime and trained a few steps on the CPU, in this process, with
  its own hyperparameters' defaults; a block with no task class is run as a script in that folder.
- YAML: a job spec, checked by the portal's own validation (elastic.spec.validate_spec); one
  with an entrypoint and no code gets a digest, as `bungee submit --code DIR` gives it, and its
  entrypoint must be a task class of a runnable block of the same page, if the page has one.
- sh: run by bash from the checkout's root, with the venv's commands first on PATH; mark only
  what runs offline in seconds.
"""

from __future__ import annotations

import ast
import math
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from markdown_it import MarkdownIt

from elastic.spec import SpecError, validate_spec
from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TRAIN_STEPS = 3
TASK_METHODS = {"model", "optimizer", "train_data", "loss"}
FILE_COMMENT = re.compile(r"#\s*(?P<path>[\w./-]+\.py)\b")
PLACEHOLDER_DIGEST = "0" * 64


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def runnable_blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page` whose info string's second word is `runnable`."""
    blocks = []
    for token in MarkdownIt().parse(page.read_text()):
        words = token.info.split()
        if token.type == "fence" and len(words) >= 2 and words[1] == "runnable":
            assert token.map is not None
            blocks.append(Block(page, token.map[0] + 1, words[0], token.content))
    return blocks


BLOCKS = [block for page in PAGES for block in runnable_blocks(page)]


def task_file(block: Block) -> Path:
    """Where a Python block is written, relative to its folder: the file its first line names."""
    found = FILE_COMMENT.match(block.text.splitlines()[0]) if block.text.strip() else None
    return Path(found.group("path")) if found else Path("task") / "task.py"


def task_classes(text: str) -> list[str]:
    """The classes of a module's source that define every required method of a task."""
    return [
        node.name
        for node in ast.parse(text).body
        if isinstance(node, ast.ClassDef)
        and TASK_METHODS <= {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    ]


def page_entrypoints(page: Path) -> set[str]:
    """module:Class of every task class in the page's runnable Python blocks."""
    return {
        f"{task_file(block).stem}:{name}"
        for block in runnable_blocks(page)
        if block.language == "python"
        for name in task_classes(block.text)
    }


def train_a_few_steps(directory: Path, entrypoint: str) -> None:
    source = directory / f"{entrypoint.split(':')[0]}.py"
    has_schema = "Hyperparameters" in source.read_text()
    task = bind_task(directory, entrypoint, {} if has_schema else {"batch_size": 8}, seed=0)
    before = [p.detach().clone() for p in task.model.parameters()]
    optimizer = task.make_optimizer()
    trainer = Trainer(
        task, optimizer, SampleStream(task.num_samples, 0), batch_size=task.batch_size, seed=0, rank=0,
        world_size=1, reduce=lambda buffer: None, scheduler=task.make_scheduler(optimizer),
    )  # fmt: skip
    losses = [trainer.step(step, stop_requested=False).loss for step in range(TRAIN_STEPS)]
    assert all(math.isfinite(loss) for loss in losses), f"{entrypoint}: losses {losses}"
    after = list(task.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"{entrypoint} learnt nothing"


def run_python(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / task_file(block)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.text)
    classes = task_classes(block.text)
    for name in classes:
        train_a_few_steps(path.parent, f"{path.stem}:{name}")
    if not classes:
        monkeypatch.chdir(path.parent)
        monkeypatch.syspath_prepend(str(path.parent))
        runpy.run_path(str(path), run_name="__main__")


def run_yaml(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = yaml.safe_load(block.text)
    if isinstance(spec, dict) and "entrypoint" in spec and "code" not in spec:
        spec["code"] = PLACEHOLDER_DIGEST
        known = page_entrypoints(block.page)
        assert not known or spec["entrypoint"] in known, (
            f"{block}: entrypoint {spec['entrypoint']!r} is none of the page's tasks: {sorted(known)}"
        )
    try:
        validate_spec(spec)
    except SpecError as err:
        pytest.fail(f"{block}: the spec is refused: {err}")


def run_sh(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text], cwd=ROOT, env={**os.environ, "PATH": path},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, f"{block}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"


RUNNERS = {"python": run_python, "yaml": run_yaml, "sh": run_sh}


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_a_runnable_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = RUNNERS.get(block.language)
    assert runner is not None, f"{block}: no way to run {block.language!r} blocks; mark one of {sorted(RUNNERS)}"
    runner(block, tmp_path, monkeypatch)


def test_the_readme_task_and_its_spec_are_runnable() -> None:
    languages = [block.language for block in runnable_blocks(ROOT / "README.md")]
    assert "python" in languages and "yaml" in languages, f"README.md's runnable blocks: {languages}"
