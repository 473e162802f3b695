"""The Slurm pool's settings (portal.slurm.config): off by default, refused with the bad value
quoted when on and unworkable, and what they make of an agent job's sbatch line and script."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from portal.config import SlurmPoolSettings
from portal.slurm.config import pool_config
from portal.slurm.pool import agent_script, sbatch_options


def raw(**changes: Any) -> SlurmPoolSettings:
    """The settings with the pool on and `changes`, each named as its variable's end (GRES=...)."""
    return settings.BUNGEE_SLURM.model_copy(update={
        "enabled": True, "portal_url": "http://portal.example:8000", "token_file": "/shared/bungee/pool.token",
        **{name.lower(): value for name, value in changes.items()},
    })


def test_off_by_default_and_then_nothing_is_required() -> None:
    config = pool_config()
    assert config.enabled is False
    assert pool_config(settings.BUNGEE_SLURM.model_copy(update={"gres": "not a gres"})).enabled is False


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"GRES": "gpu"}, "BUNGEE_SLURM_GRES='gpu' is not NAME[:TYPE]:COUNT"),
        ({"GRES": "gpu:0"}, "BUNGEE_SLURM_GRES='gpu:0'"),
        ({"TIME_LIMIT": "2 hours"}, "BUNGEE_SLURM_TIME_LIMIT='2 hours' is not a Slurm time"),
        ({"GRACE_S": 70000}, "BUNGEE_SLURM_GRACE_S=70000 must be from 1 to 65535"),
        ({"IDLE_S": -1.0}, "BUNGEE_SLURM_IDLE_S=-1.0 must be a number of seconds, at least 0"),
        ({"EVERY_S": 0.0}, "BUNGEE_SLURM_EVERY_S=0.0 must be a number of seconds above 0"),
        ({"PORTAL_URL": ""}, "BUNGEE_SLURM_PORTAL_URL must be set when BUNGEE_SLURM_ENABLED is true"),
        ({"PORTAL_URL": "portal:8000"}, "BUNGEE_SLURM_PORTAL_URL='portal:8000' is not an http(s) URL"),
        ({"TOKEN_FILE": ""}, "BUNGEE_SLURM_TOKEN_FILE must be set"),
        ({"AGENT_ARGS": "--name 'unclosed"}, "BUNGEE_SLURM_AGENT_ARGS=\"--name 'unclosed\" is not a list of shell words"),
    ],
)
def test_settings_that_cannot_work_are_refused_quoted(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        pool_config(raw(**changes))
    assert message in str(refused.value)


def test_the_system_check_reports_a_bad_setting(settings: Any) -> None:
    from portal.slurm.config import check_pool_setting

    assert check_pool_setting() == []
    settings.BUNGEE_SLURM = raw(GRES="gpu")
    (error,) = check_pool_setting()
    assert error.id == "bungee.E010" and "BUNGEE_SLURM_GRES='gpu'" in error.msg


@pytest.mark.parametrize("time_limit", ["30", "4:00:00", "1-12", "2-00:30:00", "UNLIMITED"])
def test_slurm_time_forms_are_taken(time_limit: str) -> None:
    assert pool_config(raw(TIME_LIMIT=time_limit)).time_limit == time_limit


def test_a_gpu_agent_job() -> None:
    config = pool_config(raw(GRES="gpu:a100:4", PARTITION="preemptible", ACCOUNT="ml", QOS="low",
                             TIME_LIMIT="4:00:00", GRACE_S=90, SBATCH_ARGS="--mem=64G --cpus-per-task=16"))
    assert config.devices_per_agent == 4
    options = sbatch_options(config)
    for expected in ("--job-name=bungee-agent", "--gres=gpu:a100:4", "--signal=B:TERM@90", "--requeue",
                     "--partition=preemptible", "--account=ml", "--qos=low", "--time=4:00:00", "--export=NONE",
                     "--mem=64G", "--cpus-per-task=16"):
        assert expected in options
    # Slurm tells the agent its GPUs (SLURM_JOB_GPUS): no count on its command line.
    script = agent_script(config).splitlines()
    # The agent names its node behind the pool's name, and knows the lead of the TERM before the
    # time limit (a TERM that near the job's end is the limit, not a preemption).
    # Its data directory is set, whatever --export passes (NONE here): the portal's by default.
    assert script[-2] == (f"export BUNGEE_SLURM_POOL=slurm BUNGEE_SLURM_SIGNAL_S=90 "
                          f"BUNGEE_DATA_DIR={shlex.quote(str(settings.BUNGEE.data_dir))}")
    scratch = pool_config(raw(GRES="gpu:4", AGENT_DATA_DIR="/local/scratch/bungee"))
    assert agent_script(scratch).splitlines()[-2].endswith(" BUNGEE_DATA_DIR=/local/scratch/bungee")
    assert shlex.split(script[-1]) == ["exec", "python3", "-m", "agent", "--slurm", "--portal", "http://portal.example:8000",
                                    "--token-file", "/shared/bungee/pool.token"]


def test_a_simulated_agent_job_is_told_its_device_count() -> None:
    config = pool_config(raw(GRES="slot:2", PYTHON="/opt/bungee/.venv/bin/python", AGENT_ARGS="--sim-pace 4"))
    assert not any(o.startswith(("--partition", "--account", "--qos", "--time")) for o in sbatch_options(config))
    assert shlex.split(agent_script(config).splitlines()[-1]) == [
        "exec", "/opt/bungee/.venv/bin/python", "-m", "agent", "--slurm", "--portal", "http://portal.example:8000",
        "--token-file", "/shared/bungee/pool.token", "--devices", "2", "--sim-pace", "4",
    ]
    assert pool_config(raw(GRES="slot:4", DEVICES_PER_AGENT=2)).devices_per_agent == 2


def test_a_pool_name_with_a_dash_is_refused() -> None:
    """A pool token of pool "a" could otherwise register the nodes of pool "a-b"."""
    with pytest.raises(ImproperlyConfigured, match="BUNGEE_SLURM_POOL='a-b' is not a pool's name"):
        pool_config(raw(POOL="a-b"))


def test_the_beat_sizes_the_pool_only_when_it_is_on(settings: Any) -> None:
    from portal.celery import _beat_schedule, app

    schedule = app.conf.beat_schedule
    saved = dict(schedule)
    try:
        schedule.clear()
        _beat_schedule(app)
        assert "slurm pool" not in schedule and "scheduler tick" in schedule
        settings.BUNGEE_SLURM = raw(EVERY_S=7.0)
        _beat_schedule(app)
        assert schedule["slurm pool"]["task"] == "portal.slurm.tasks.size_pool"
        assert schedule["slurm pool"]["schedule"] == 7.0
    finally:
        schedule.clear()
        schedule.update(saved)
