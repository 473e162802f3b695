"""elastic.codepack.check_entrypoint: a job's entrypoint is looked for in its code's source,
parsed and never run (the portal at submit, the CLI before it uploads)."""

from __future__ import annotations

import io

import pytest

from elastic.codepack import EntrypointError, check_entrypoint, repack
from tests.code_support import tar_gz

NEVER_RUN = b"raise SystemExit('this module was run')\n"


def canonical(files: dict[str, bytes]) -> io.BytesIO:
    out = io.BytesIO()
    repack(io.BytesIO(tar_gz(files)), out, 10**6, 100)
    out.seek(0)
    return out


@pytest.mark.parametrize(
    ("files", "entrypoint"),
    [
        ({"task.py": NEVER_RUN + b"class Task:\n    pass\n"}, "task:Task"),
        ({"task.py": NEVER_RUN + b"from model import Task\n", "model.py": b""}, "task:Task"),
        ({"task.py": NEVER_RUN + b"try:\n    import fast as Task\nexcept ImportError:\n    class Task: ...\n"},
         "task:Task"),
        ({"pkg/__init__.py": b"", "pkg/train.py": NEVER_RUN + b"Task = type('Task', (), {})\n", "run.py": b""},
         "pkg.train:Task"),
        ({"pkg/__init__.py": b"from .train import *\n", "pkg/train.py": b"", "run.py": b""}, "pkg:Task"),
    ],
)
def test_a_class_the_module_binds_is_found_without_running_it(files: dict[str, bytes], entrypoint: str) -> None:
    check_entrypoint(canonical(files), entrypoint)


@pytest.mark.parametrize(
    ("files", "entrypoint", "said"),
    [
        ({"task.py": b"class Net: ...\nclass Trainer: ...\ndef Task(): ...\n"}, "task:Tsk",
         "module 'task' defines no class 'Tsk'; its classes: Net, Trainer"),
        ({"task.py": b"x = 1\n"}, "task:Task", "defines no class 'Task'; it defines no class at all"),
        ({"task.py": b"", "lib/util.py": b""}, "train:Task",
         "the code has no module 'train' (no train.py or train/__init__.py at its top); its modules: lib.util, task"),
        ({"task.py": b"class Task(:\n"}, "task:Task", "module 'task' does not parse"),
    ],
)
def test_a_missing_module_or_class_is_named_with_what_is_there(
    files: dict[str, bytes], entrypoint: str, said: str
) -> None:
    with pytest.raises(EntrypointError) as raised:
        check_entrypoint(canonical(files), entrypoint)
    assert said in str(raised.value) and repr(entrypoint) in str(raised.value)
