"""What a job is told when its environment does not build: the message reads as
one sentence after another (never "..": uv's cause ends with a period of its own; a task's exception
is pinned the same way in test_scheduler_cycle), and a package missing from an offline wheelhouse is told in the words that
docs/operator/environments.md quotes, so that an operator who searches the page for it finds it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.environments import BuildFailed, Environments, EnvironmentSettings, uv_binary
from elastic.requirements import declared_in
from tests.environment_support import tiny_wheelhouse
from tests.test_scheduler_cycle import event, report, run_cycle, submit

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENTS_PAGE = ROOT / "docs" / "operator" / "environments.md"


def test_a_package_missing_from_the_wheelhouse_fails_in_the_words_the_docs_quote(tmp_path: Path) -> None:
    page = " ".join(ENVIRONMENTS_PAGE.read_text().split())
    quoted = re.search(r'fails the job at once \("(\S+) ([^"]+)"', page)
    assert quoted, "the page quotes what a wheelhouse miss says"
    package, words = quoted.groups()
    environments = Environments(
        EnvironmentSettings(root=tmp_path / "environments", python=sys.executable, uv=uv_binary(),
                            find_links=(str(tiny_wheelhouse(tmp_path / "wheels")),)),
        {"PATH": os.defpath, "UV_OFFLINE": "1"},  # as the page says to run a wheelhouse
    )
    found = declared_in({"requirements.txt": f"{package}==1.0\n".encode()})
    assert found is not None
    with pytest.raises(BuildFailed) as failed:
        environments.ensure(found)
    assert f"{package} {words}" in str(failed.value), str(failed.value)


@pytest.mark.django_db
def test_an_environment_that_does_not_build_is_told_without_a_double_period(api: dict, cluster: Any) -> None:
    job = submit(api)
    run_cycle()
    job.refresh_from_db()
    gist = ("No solution found when resolving dependencies: Because nosuchpkg was not found in the cache and you "
            "require nosuchpkg==1.0, we can conclude that your requirements are unsatisfiable.")
    report(cluster, event(job, "exited", rank=0, reason="user_error", device_index=0,
                          message=f"the job's environment could not be built: {gist}"))
    job.refresh_from_db()
    assert job.state == "failed" and "requirements are unsatisfiable" in job.message
    assert ".." not in job.message, job.message
