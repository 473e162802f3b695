"""`make demo`'s own settings (portal.config.DemoSettings): the portal's port and the demo node's
simulated devices come from PORT and BUNGEE_SIM_DEVICES, and a bad value stops
`python -m portal.demo` before it starts anything, quoting the variable and the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from portal.config import DemoSettings

ROOT = Path(__file__).resolve().parent.parent


def test_the_defaults_and_the_variables() -> None:
    assert (DemoSettings.from_environ({}).port, DemoSettings.from_environ({}).devices) == (8000, 4)
    given = DemoSettings.from_environ({"PORT": "8123", "BUNGEE_SIM_DEVICES": "2"})
    assert (given.port, given.devices) == (8123, 2)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PORT": "eighty"}, "PORT='eighty': Input should be a valid integer"),
        ({"PORT": "70000"}, "PORT='70000': Input should be less than or equal to 65535"),
        ({"BUNGEE_SIM_DEVICES": "0"}, "BUNGEE_SIM_DEVICES='0': Input should be greater than or equal to 1"),
        (
            {"BUNGEE_SCHEDULE_TICK_S": "often"},
            "BUNGEE_SCHEDULE_TICK_S='often': Input should be a valid number",
        ),
    ],
)
def test_a_bad_value_stops_the_demo_before_it_starts(
    environ: dict[str, str], message: str, tmp_path: Path
) -> None:
    """The portal's settings are checked too: the demo reads its data directory and queue there."""
    done = subprocess.run(
        [sys.executable, "-m", "portal.demo", "--no-jobs"],
        cwd=ROOT,
        env={**os.environ, "BUNGEE_DATA_DIR": str(tmp_path), **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert list(tmp_path.iterdir()) == []  # no database, no logs, no Redis: nothing was started
