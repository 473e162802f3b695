"""A job whose own code fails to import: the user is shown the frames of their own files once
(paths relative to their code's directory, and the exception's line), not the platform's
(runpy, importlib, elastic/...) from every worker. The worker's log lines are made by the
worker's own function from a real import error, and so is the UserError the worker's exit announces
(the agent reports it in the "exited" event); the portal turns that into the job's message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic.tasks.api import TaskDefinitionError, users_traceback
from elastic.tasks.loader import load_task_class
from elastic.worker import WHOLE_TRACEBACK_HEAD
from elastic.worker.runner import user_error_report
from tests.test_scheduler_cycle import event, report, training_on_two

PLATFORM_FRAMES = ("elastic/", "importlib", "<frozen", "runpy")


def broken_code(directory: Path) -> Path:
    """A task whose module imports a helper of its own that imports a module nobody has."""
    directory.mkdir()
    (directory / "task.py").write_text("import helper\n\n\nclass Task:\n    pass\n")
    (directory / "helper.py").write_text("X = 1\nimport no_such_module_anywhere  # noqa\n")
    return directory


def import_error(directory: Path) -> TaskDefinitionError:
    with pytest.raises(TaskDefinitionError) as failed:
        load_task_class(directory, "task:Task")
    return failed.value


def test_the_users_traceback_holds_their_frames_and_the_exception_only(tmp_path: Path) -> None:
    code = broken_code(tmp_path / "code")
    error = import_error(code)
    assert "elastic/tasks/loader.py" in error.traceback_text, "the whole traceback has the platform's frames"
    own = users_traceback(error, code)
    assert own.splitlines() == [
        "Traceback (most recent call last):",
        '  File "task.py", line 1, in <module>',
        "    import helper",
        '  File "helper.py", line 2, in <module>',
        "    import no_such_module_anywhere  # noqa",
        "ModuleNotFoundError: No module named 'no_such_module_anywhere'",
    ]


@pytest.mark.django_db
def test_the_jobs_message_shows_the_users_frames_once(tmp_path: Path, api: dict, cluster: Any) -> None:
    code = broken_code(tmp_path / "code")
    job = training_on_two(api, cluster)
    for rank in (0, 1):  # both workers fail on the same import, each with its log lines
        lines, user_error = user_error_report(import_error(code), code)
        assert len(lines) == 2 and lines[1].startswith(WHOLE_TRACEBACK_HEAD)
        report(cluster, *(event(job, "log", rank=rank, message=line) for line in lines))
    report(cluster, event(job, "exited", rank=1, exit_code=77, reason="user_error", device_index=1,
                          user_error=user_error.model_dump()))
    job.refresh_from_db()
    assert job.state == "failed", job.message
    assert job.message.count('File "helper.py", line 2, in <module>') == 1, job.message
    assert job.message.count("ModuleNotFoundError: No module named 'no_such_module_anywhere'") == 2, (
        "the error in the message's first sentence, and as the traceback's last line"
    )
    assert not any(frame in job.message for frame in PLATFORM_FRAMES), job.message
    assert "The whole traceback is in the log" in job.message
    logged = "\n".join(job.logs.values_list("line", flat=True))
    assert "elastic/tasks/loader.py" in logged, "the platform's frames are still in the log"
