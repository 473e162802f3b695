"""The Slurm pool's settings checked: settings.BUNGEE_SLURM (portal.config.SlurmPoolSettings,
which says what each one means) made into a PoolConfig, or ImproperlyConfigured quoting the bad
value. The values' types and simplest bounds are checked as they are read; whether they can work
together only when the pool is on. The Celery worker and beat refuse to start on a bad one
(portal.celery), and so does every management command (a system check, portal.slurm.apps).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from elastic.wire import POOL_NAME_PATTERN
from portal.config import SlurmPoolSettings

GRES_PATTERN = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(:[A-Za-z0-9_.\-]+)?:(?P<count>[1-9][0-9]*)$")
TIME_PATTERN = re.compile(r"^(\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|UNLIMITED|INFINITE)$")
MAX_SIGNAL_S = 65535
"""The most seconds --signal's @TIME takes (Slurm keeps it in 16 bits)."""


@dataclass(frozen=True)
class PoolConfig:
    enabled: bool
    pool: str
    partition: str
    account: str
    qos: str
    gres: str
    devices_per_agent: int
    time_limit: str
    grace_s: int
    max_agents: int
    idle_s: float
    start_timeout_s: float
    agent_args: tuple[str, ...]
    sbatch_args: tuple[str, ...]
    portal_url: str
    token_file: str
    python: str
    workdir: str
    output: str
    agent_data_dir: str
    """BUNGEE_DATA_DIR of the agents (their state directories are under it)."""
    export: str
    job_name: str
    every_s: float
    command_timeout_s: float
    gres_name: str
    """The gres's NAME: gpu, or another (simulated slots), whose count the agent is told."""


def _words(variable: str, text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as err:
        raise ImproperlyConfigured(f"{variable}={text!r} is not a list of shell words: {err}") from None


def pool_config(raw: SlurmPoolSettings | None = None) -> PoolConfig:
    """The pool's settings from `raw` (default settings.BUNGEE_SLURM). Raises
    ImproperlyConfigured, quoting the variable and its value, for one that cannot work; when the
    pool is off only the types are checked (as they are read: portal.config)."""
    if raw is None:
        raw = settings.BUNGEE_SLURM
    gres = raw.gres.strip()
    match = GRES_PATTERN.match(gres)
    time_limit = raw.time_limit.strip()
    config = PoolConfig(
        enabled=raw.enabled,
        pool=raw.pool.strip(),
        partition=raw.partition.strip(),
        account=raw.account.strip(),
        qos=raw.qos.strip(),
        gres=gres,
        devices_per_agent=raw.devices_per_agent or (int(match["count"]) if match else 0),
        time_limit=time_limit,
        grace_s=raw.grace_s,
        max_agents=raw.max_agents,
        idle_s=raw.idle_s,
        start_timeout_s=raw.start_timeout_s,
        agent_args=_words("BUNGEE_SLURM_AGENT_ARGS", raw.agent_args),
        sbatch_args=_words("BUNGEE_SLURM_SBATCH_ARGS", raw.sbatch_args),
        portal_url=raw.portal_url.strip(),
        token_file=raw.token_file.strip(),
        python=raw.python.strip(),
        workdir=str(raw.workdir).strip(),
        output=raw.output.strip() or str(settings.BUNGEE.data_dir / "slurm" / "%x-%j.out"),
        agent_data_dir=raw.agent_data_dir.strip() or str(settings.BUNGEE.data_dir),
        export=raw.export.strip(),
        job_name=raw.job_name.strip(),
        every_s=raw.every_s,
        command_timeout_s=raw.command_timeout_s,
        gres_name=match["name"] if match else "",
    )
    if not config.enabled:
        return config
    if not re.fullmatch(POOL_NAME_PATTERN, config.pool):
        raise ImproperlyConfigured(
            f"BUNGEE_SLURM_POOL={config.pool!r} is not a pool's name ({POOL_NAME_PATTERN}: no '-')"
        )
    if match is None:
        raise ImproperlyConfigured(f"BUNGEE_SLURM_GRES={gres!r} is not NAME[:TYPE]:COUNT (e.g. gpu:4 or slot:2)")
    if time_limit and not TIME_PATTERN.match(time_limit):
        raise ImproperlyConfigured(
            f"BUNGEE_SLURM_TIME_LIMIT={time_limit!r} is not a Slurm time (minutes, H:MM:SS, D-HH, D-HH:MM:SS, ...)"
        )
    if not 1 <= config.grace_s <= MAX_SIGNAL_S:
        raise ImproperlyConfigured(f"BUNGEE_SLURM_GRACE_S={config.grace_s!r} must be from 1 to {MAX_SIGNAL_S} seconds")
    for variable, value in (("BUNGEE_SLURM_IDLE_S", config.idle_s), ("BUNGEE_SLURM_START_TIMEOUT_S", config.start_timeout_s)):
        if not value >= 0:
            raise ImproperlyConfigured(f"{variable}={value!r} must be a number of seconds, at least 0")
    for variable, value in (("BUNGEE_SLURM_EVERY_S", config.every_s), ("BUNGEE_SLURM_COMMAND_TIMEOUT_S", config.command_timeout_s)):
        if not value > 0:
            raise ImproperlyConfigured(f"{variable}={value!r} must be a number of seconds above 0")
    for variable, text in (
        ("BUNGEE_SLURM_PORTAL_URL", config.portal_url),
        ("BUNGEE_SLURM_TOKEN_FILE", config.token_file),
        ("BUNGEE_SLURM_PYTHON", config.python),
        ("BUNGEE_SLURM_WORKDIR", config.workdir),
        ("BUNGEE_SLURM_OUTPUT", config.output),
        ("BUNGEE_SLURM_EXPORT", config.export),
        ("BUNGEE_SLURM_JOB_NAME", config.job_name),
    ):
        if not text:
            raise ImproperlyConfigured(f"{variable} must be set when BUNGEE_SLURM_ENABLED is true")
    if not re.match(r"^https?://", config.portal_url):
        raise ImproperlyConfigured(f"BUNGEE_SLURM_PORTAL_URL={config.portal_url!r} is not an http(s) URL")
    return config


def check_pool_setting(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Django system check: the pool's settings can work (when it is on)."""
    try:
        pool_config()
    except ImproperlyConfigured as err:
        return [checks.Error(str(err), id="bungee.E010", hint="see portal/slurm/config.py")]
    return []
