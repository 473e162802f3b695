"""The Slurm pool's settings, typed and checked: settings.BUNGEE_SLURM (read from the environment
in portal.settings) made into a PoolConfig, or ImproperlyConfigured quoting the bad value. The
Celery worker and beat refuse to start on a bad one (portal.celery), and so does every
management command (a system check, portal.slurm.apps).

| variable | default | what |
|---|---|---|
| BUNGEE_SLURM_ENABLED | false | run the pool at all |
| BUNGEE_SLURM_POOL | slurm | the pool's name: its agents' nodes are named POOL-NODE-jobID, the names its pool token (create_token --role pool --pool POOL) may register |
| BUNGEE_SLURM_PARTITION, _ACCOUNT, _QOS | the cluster's defaults | where agent jobs are submitted (sbatch --partition, --account, --qos) |
| BUNGEE_SLURM_GRES | gpu:1 | what one agent job asks for (--gres), NAME[:TYPE]:COUNT |
| BUNGEE_SLURM_DEVICES_PER_AGENT | the gres count | devices one agent brings; with a gres other than gpu, passed to it as --devices (Slurm tells a job nothing of such a gres) |
| BUNGEE_SLURM_TIME_LIMIT | the partition's | --time, in Slurm's forms (minutes, H:MM:SS, D-HH, ...) |
| BUNGEE_SLURM_GRACE_S | 120 | --signal=B:TERM@GRACE: the agent drains from GRACE seconds before its time limit (and, where the cluster sets preempt_send_user_signal, when it is preempted) |
| BUNGEE_SLURM_MAX_AGENTS | 4 | the most agent jobs at once, pending or running |
| BUNGEE_SLURM_IDLE_S | 600 | an agent whose node held no job for this long is cancelled, if the cluster can spare its devices |
| BUNGEE_SLURM_START_TIMEOUT_S | 600 | an agent job running this long without its node registering is cancelled (reported as an error) |
| BUNGEE_SLURM_PORTAL_URL | (required) | the portal's URL as the agents reach it |
| BUNGEE_SLURM_TOKEN_FILE | (required) | the pool's agent credential, a file the agents read on the compute node |
| BUNGEE_SLURM_PYTHON | python3 | the interpreter that runs `-m agent` on the compute node |
| BUNGEE_SLURM_WORKDIR | the project | --chdir: where `agent` is importable on the compute node |
| BUNGEE_SLURM_OUTPUT | BUNGEE_DATA_DIR/slurm/%x-%j.out | --output of agent jobs (a shared file system: the portal makes the folder) |
| BUNGEE_SLURM_EXPORT | NONE | --export: NONE gives the agent the submitting user's login environment, never the portal's secrets |
| BUNGEE_SLURM_AGENT_ARGS, _SBATCH_ARGS | none | more agent flags, more sbatch options (shell words) |
| BUNGEE_SLURM_JOB_NAME | bungee-agent | the pool's jobs are those of this name and the portal's user |
| BUNGEE_SLURM_EVERY_S | 15 | how often the beat sizes the pool |
| BUNGEE_SLURM_COMMAND_TIMEOUT_S | 30 | the longest a Slurm command may take |
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from portal.accounts.models import POOL_NAME_PATTERN

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


def pool_config(raw: Mapping[str, Any] | None = None) -> PoolConfig:
    """The pool's settings from `raw` (default settings.BUNGEE_SLURM). Raises
    ImproperlyConfigured, quoting the variable and its value, for one that cannot work; when the
    pool is off only the types are checked (by portal.settings)."""
    if raw is None:
        raw = settings.BUNGEE_SLURM
    gres = str(raw["GRES"]).strip()
    match = GRES_PATTERN.match(gres)
    time_limit = str(raw["TIME_LIMIT"]).strip()
    config = PoolConfig(
        enabled=bool(raw["ENABLED"]),
        pool=str(raw.get("POOL", "slurm")).strip(),
        partition=str(raw["PARTITION"]).strip(),
        account=str(raw["ACCOUNT"]).strip(),
        qos=str(raw["QOS"]).strip(),
        gres=gres,
        devices_per_agent=int(raw["DEVICES_PER_AGENT"]) or (int(match["count"]) if match else 0),
        time_limit=time_limit,
        grace_s=int(raw["GRACE_S"]),
        max_agents=int(raw["MAX_AGENTS"]),
        idle_s=float(raw["IDLE_S"]),
        start_timeout_s=float(raw["START_TIMEOUT_S"]),
        agent_args=_words("BUNGEE_SLURM_AGENT_ARGS", str(raw["AGENT_ARGS"])),
        sbatch_args=_words("BUNGEE_SLURM_SBATCH_ARGS", str(raw["SBATCH_ARGS"])),
        portal_url=str(raw["PORTAL_URL"]).strip(),
        token_file=str(raw["TOKEN_FILE"]).strip(),
        python=str(raw["PYTHON"]).strip(),
        workdir=str(raw["WORKDIR"]).strip(),
        output=str(raw["OUTPUT"]).strip(),
        export=str(raw["EXPORT"]).strip(),
        job_name=str(raw["JOB_NAME"]).strip(),
        every_s=float(raw["EVERY_S"]),
        command_timeout_s=float(raw["COMMAND_TIMEOUT_S"]),
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
