"""Importing a task from its code directory, and constructing it for a job.

The directory goes first on `sys.path`, so the task imports its own modules as a script of that
directory would (`import model`, `from data import Frames`). Modules imported from another
task's directory earlier in the same process (tests load several) are forgotten first, so that a
module name two tasks share never resolves to the other's file: nothing of another job is on the
path. A worker process loads exactly one task."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from elastic.tasks.api import TASK_METHODS, Job, TaskDefinitionError
from elastic.tasks.missing import missing_module_advice

_LOADED_FROM: dict[str, Path] = {}
"""Module name -> the task directory it was imported from, in this process."""
_DIRECTORIES: set[Path] = set()
"""Every task directory this process has put on sys.path."""


def _forget_other_tasks(directory: Path) -> None:
    for name, origin in list(_LOADED_FROM.items()):
        if origin != directory:
            sys.modules.pop(name, None)
            del _LOADED_FROM[name]
    for other in _DIRECTORIES - {directory}:
        while str(other) in sys.path:
            sys.path.remove(str(other))
    importlib.invalidate_caches()


def _under(path: str | None, directory: Path) -> bool:
    if not path:
        return False
    try:
        return Path(path).resolve().is_relative_to(directory)
    except (OSError, ValueError):
        return False


def load_module(directory: Path, name: str) -> ModuleType:
    """Imports module `name` from the task directory `directory`. Raises TaskDefinitionError,
    with the traceback, if the directory or the module is missing or its import raises."""
    directory = directory.resolve()
    if not directory.is_dir():
        raise TaskDefinitionError(f"the task directory {str(directory)!r} does not exist")
    _forget_other_tasks(directory)
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    _DIRECTORIES.add(directory)
    before = set(sys.modules)
    try:
        module = importlib.import_module(name)
    except Exception as err:
        raise TaskDefinitionError(
            f"importing {name!r} from the job's code failed: {type(err).__name__}: {err}{missing_module_advice(err)}",
            traceback.format_exc(),
        ) from err
    finally:
        for added in set(sys.modules) - before:
            if _under(getattr(sys.modules[added], "__file__", None), directory):
                _LOADED_FROM[added] = directory
    if not _under(getattr(module, "__file__", None), directory):
        raise TaskDefinitionError(
            f"module {name!r} is not in the job's code: it resolved to {getattr(module, '__file__', None)!r}"
        )
    return module


def parse_entrypoint(entrypoint: str) -> tuple[str, str]:
    """Splits `module:ClassName` (the module may be dotted). Raises TaskDefinitionError."""
    module_name, colon, attribute = entrypoint.partition(":")
    if not colon or not module_name or not attribute.isidentifier():
        raise TaskDefinitionError(f"entrypoint {entrypoint!r} is not of the form module:ClassName")
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise TaskDefinitionError(f"entrypoint {entrypoint!r}: {module_name!r} is not a module name")
    return module_name, attribute


def load_task_class(directory: Path, entrypoint: str) -> type[Any]:
    """Returns the task class `entrypoint` names in `directory`. Raises TaskDefinitionError if
    it is missing, not a class, or lacks a method every task defines (api.TASK_METHODS)."""
    module_name, attribute = parse_entrypoint(entrypoint)
    module = load_module(directory, module_name)
    task_class = getattr(module, attribute, None)
    if not isinstance(task_class, type):
        raise TaskDefinitionError(f"module {module_name!r} defines no class {attribute!r}")
    missing = [name for name in TASK_METHODS if not callable(getattr(task_class, name, None))]
    if missing:
        raise TaskDefinitionError(f"task {entrypoint!r} does not define {', '.join(missing)}")
    return task_class


def construct_task(task_class: type[Any], hyperparameters: Any, job: Job | None) -> Any:
    """`task_class` constructed with its validated `hyperparameters` and given `job` as its
    attribute `job` (api.Job), unless its own `__init__` set a `job` (a task written before
    Bungee gave one keeps its own). Without `job` (a task bound outside a job: a test) it gets
    none."""
    task = task_class(hyperparameters)
    own = getattr(task, "__dict__", None)
    if job is not None and own is not None and "job" not in own:
        task.job = job
    return task
