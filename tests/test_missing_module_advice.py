"""A job whose code imports a module that neither the node nor the job's packages have is told to
add the package that provides it to the requirements.txt beside its code (elastic.tasks.missing),
whether the import is at the top of its module or inside a method; a module that is there, with a
submodule missing, gets no such advice. The portal's job message is the first line of this error
(tests/test_integration_resize_in_place.py follows it through the platform)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from elastic.tasks.api import TaskDefinitionError, UserCodeError
from elastic.tasks.loader import load_task_class
from elastic.tasks.runtime import bind_task
from tests.test_tasks import MINIMAL, write_task

ADVICE = "is installed neither on the node nor in the job's packages: add "


def load_error(tmp_path: Path, task: str) -> str:
    with pytest.raises(TaskDefinitionError) as caught:
        load_task_class(write_task(tmp_path / "task", task=task), "task:Task")
    return str(caught.value)


def test_a_module_nowhere_is_to_be_added_to_the_requirements(tmp_path: Path) -> None:
    message = load_error(tmp_path, "import bungee_nowhere.layers\n")
    assert message == (
        "importing 'task' from the job's code failed: ModuleNotFoundError: No module named 'bungee_nowhere'. "
        "'bungee_nowhere' is installed neither on the node nor in the job's packages: add the package that "
        "provides 'bungee_nowhere' to the requirements.txt beside the code"
    )


def test_a_module_whose_package_has_another_name_names_the_package(tmp_path: Path) -> None:
    if importlib.util.find_spec("skimage") is not None:
        pytest.skip("scikit-image is installed here")
    message = load_error(tmp_path, "from skimage import io\n")
    assert f"'skimage' {ADVICE}scikit-image (the package that provides 'skimage') to the requirements.txt" in message


def test_a_missing_submodule_of_an_installed_package_is_no_missing_package(tmp_path: Path) -> None:
    message = load_error(tmp_path, "import numpy.bungee_no_such_part\n")
    assert "No module named 'numpy.bungee_no_such_part'" in message and ADVICE not in message


def test_an_import_inside_a_method_gets_the_advice_too(tmp_path: Path) -> None:
    task = MINIMAL.replace("def model(self):", "def model(self):\n            import bungee_layers_nowhere")
    directory = write_task(tmp_path / "task", task=task, helper="WIDTH = 1\n")
    with pytest.raises(UserCodeError) as caught:
        bind_task(directory, "task:Task", {"batch_size": 2}, seed=0)
    assert f"'bungee_layers_nowhere' {ADVICE}the package that provides 'bungee_layers_nowhere'" in str(caught.value)
