"""The portal's settings (portal.config.PortalSettings): defaults with nothing set, values read
from their variables, and a bad value refused at start with ImproperlyConfigured quoting the
variable and the value, both in the class and in a real `manage.py` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from portal.config import BASE_DIR, PortalSettings, SlurmPoolSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_need_no_environment() -> None:
    settings = load_settings(PortalSettings, {})
    assert settings == PortalSettings.from_environ({})
    assert (settings.node_timeout_s, settings.redis_prefix, settings.code_max_bytes) == (
        15.0,
        "bungee",
        50 * 2**20,
    )
    assert settings.data_dir == BASE_DIR / "var" and settings.code_dir == BASE_DIR / "var" / "code"
    assert settings.allowed_hosts == ["127.0.0.1", "localhost", "[::1]", "testserver"]
    assert settings.database_url is None and settings.debug is False


def test_values_are_read_from_their_variables() -> None:
    settings = load_settings(
        PortalSettings,
        {
            "BUNGEE_NODE_TIMEOUT_S": "5",
            "BUNGEE_MAX_RESTARTS": "0",
            "BUNGEE_ENV_INDEX_OPTIONS": "true",
            "ALLOWED_HOSTS": "portal.lab, 10.0.0.2,",
            "DEBUG": "1",
            "BUNGEE_DATA_DIR": "/srv/bungee",
            "BUNGEE_REDIS_PREFIX": "",  # empty: unset, as it always was
        },
    )
    assert (settings.node_timeout_s, settings.max_restarts, settings.env_index_options) == (5.0, 0, True)
    assert settings.allowed_hosts == ["portal.lab", "10.0.0.2"] and settings.debug is True
    assert settings.artifact_dir == Path("/srv/bungee/artifacts") and settings.redis_prefix == "bungee"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BUNGEE_NODE_TIMEOUT_S", "soon"),
        ("BUNGEE_NODE_TIMEOUT_S", "0"),
        ("BUNGEE_LOGIN_FAILURE_LIMIT", "0"),
        ("BUNGEE_MASTER_PORT_BASE", "70000"),
        ("BUNGEE_ENV_INDEX_OPTIONS", "maybe"),
        ("DEBUG", "sometimes"),
        ("LOG_LEVEL", "LOUD"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(name: str, value: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"{name}='{value}'"):
        load_settings(PortalSettings, {name: value})


def test_every_bad_value_is_named_at_once() -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        load_settings(PortalSettings, {"BUNGEE_MAX_RESTARTS": "-1", "BUNGEE_CODE_MAX_FILES": "many"})
    assert "BUNGEE_MAX_RESTARTS='-1'" in str(refused.value) and "BUNGEE_CODE_MAX_FILES='many'" in str(
        refused.value
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [("BUNGEE_SLURM_ENABLED", "perhaps"), ("BUNGEE_SLURM_GRACE_S", "0"), ("BUNGEE_SLURM_MAX_AGENTS", "-1")],
)
def test_a_bad_slurm_pool_value_is_refused_naming_the_variable_and_the_value(name: str, value: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"{name}='{value}'"):
        load_settings(SlurmPoolSettings, {name: value})


def test_a_bad_value_stops_the_portal_at_start() -> None:
    environ = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings", "BUNGEE_SCHEDULE_TICK_S": "often"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured: BUNGEE_SCHEDULE_TICK_S='often'" in result.stderr
