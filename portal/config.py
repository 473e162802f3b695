"""The portal's configuration, one typed class (PortalSettings): every setting of the portal, its
Celery worker and beat, each with its type, default, bounds, environment variable and meaning.

portal/settings.py reads it once, at start, as `settings.BUNGEE` (`load_settings`); a value that
does not parse, or is out of bounds, stops the process there with ImproperlyConfigured quoting
the variable and the value. Code reads typed attributes (`settings.BUNGEE.node_timeout_s`);
tests change one with Django's settings fixture,
`settings.BUNGEE = settings.BUNGEE.model_copy(update={"node_timeout_s": 5.0})`. The defaults
make a laptop run work with no configuration at all. The Slurm pool's settings are a class of
their own (SlurmPoolSettings, `settings.BUNGEE_SLURM`), whose values portal.slurm.config checks
further when the pool is on, and so are `make demo`'s (DemoSettings).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from django.core.exceptions import ImproperlyConfigured
from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from elastic.environ_settings import EnvironSettings, SettingsError
from elastic.wire import POOL_NAME_PATTERN

BASE_DIR = Path(__file__).resolve().parent.parent
"""The checkout."""

CommaList = Annotated[list[str], NoDecode]
"""A list written as comma-separated words in its variable."""


class PortalSettings(EnvironSettings):
    """The portal's settings (see the module's docstring)."""

    # --- Django, the database, Redis -------------------------------------------------------------
    data_dir: Path = Field(
        BASE_DIR / "var",
        validation_alias="BUNGEE_DATA_DIR",
        description="Where the portal keeps its files: the SQLite database, logs, job checkpoints (runs/), code "
        "and artifacts.",
    )
    secret_key: str = Field(
        "bungee-development-key-change-me-in-production",
        validation_alias="SECRET_KEY",
        description="With DEBUG off the portal refuses this default (portal.secrets_check); `make demo` makes its "
        "own.",
    )
    debug: bool = Field(
        False, validation_alias="DEBUG", description="Django's debug pages; never in production."
    )
    allowed_hosts: CommaList = Field(
        ["127.0.0.1", "localhost", "[::1]", "testserver"],
        validation_alias="ALLOWED_HOSTS",
        description="The host names the portal answers to, comma-separated.",
    )
    csrf_trusted_origins: CommaList = Field(
        [],
        validation_alias="CSRF_TRUSTED_ORIGINS",
        description="The origins (scheme and host) from which forms may be posted, comma-separated: the portal's "
        "own address as browsers see it behind a proxy that changes it.",
    )
    login_failure_limit: int = Field(
        5,
        ge=1,
        validation_alias="BUNGEE_LOGIN_FAILURE_LIMIT",
        description="Failed logins for one user, from any address, before that user is locked.",
    )
    login_cooloff_min: int = Field(
        15,
        ge=1,
        validation_alias="BUNGEE_LOGIN_COOLOFF_MIN",
        description="Minutes a locked user stays locked, from the failure that locked it.",
    )
    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        description="The database, as a URL (PostgreSQL in production: postgres://USER:PASSWORD@HOST:PORT/NAME); "
        "unset: sqlite:///DATA_DIR/bungee.sqlite3.",
    )
    db_pool_size: int = Field(
        8,
        ge=1,
        validation_alias="BUNGEE_DB_POOL_SIZE",
        description="PostgreSQL only: the most connections each process (portal, Celery worker, beat) holds.",
    )
    db_pool_timeout_s: float = Field(
        10.0,
        gt=0,
        validation_alias="BUNGEE_DB_POOL_TIMEOUT_S",
        description="PostgreSQL only: how long a request waits for one of them, in seconds.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias="REDIS_URL",
        description="The Redis of the Celery broker, the Channels layer, the agents' command streams and live "
        "metrics, as the portal's own ACL user (redis://USER:PASSWORD@HOST:6379/0): it makes each agent's and each "
        "job's user, so it needs every right (docs/operator/security.md, Redis users).",
    )
    channel_prefix: str = Field(
        "bungee",
        validation_alias="BUNGEE_CHANNEL_PREFIX",
        description="The Channels layer's key prefix, so that deployments can share a Redis.",
    )
    socket_group_expiry_s: int = Field(
        120,
        ge=1,
        validation_alias="BUNGEE_SOCKET_GROUP_EXPIRY_S",
        description="A socket that is gone without leaving its groups (the portal was killed) drops out of them "
        "after this; a live one renews its membership well before (portal.live).",
    )
    live_coalesce: bool = Field(
        True,
        validation_alias="BUNGEE_LIVE_COALESCE",
        description="Boards get a scheduling cycle's job changes as one message, and a socket that is behind gets "
        "only the newest state of each job it has not been sent yet (portal.live.outbox). Off: one message per job "
        "change, each written to every socket in turn (for comparison: bench/live.py --burst).",
    )
    live_outbox_limit: int = Field(
        1000,
        ge=10,
        validation_alias="BUNGEE_LIVE_OUTBOX_LIMIT",
        description="The most messages a socket may have waiting beyond the newest state of each job; a socket that "
        "falls further behind is closed (4429), and its page reconnects and starts again from a snapshot.",
    )
    celery_queue: str = Field(
        "bungee",
        validation_alias="BUNGEE_CELERY_QUEUE",
        description="The Celery queue of the portal's tasks, so that deployments can share a Redis.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", validation_alias="LOG_LEVEL", description="The portal's logging level."
    )

    # --- the processes: the server (portal.serve), the Celery worker and beat (portal.liveness) -----
    forwarded_allow_ips: CommaList = Field(
        [],
        validation_alias="BUNGEE_FORWARDED_ALLOW_IPS",
        description="`python -m portal.serve`: the reverse proxies in front of the portal, as addresses or "
        'networks, comma-separated ("*": any): only their X-Forwarded-For and X-Forwarded-Proto are believed. '
        "Empty: nobody's.",
    )
    pool_limits: CommaList = Field(
        [],
        validation_alias="BUNGEE_POOL_LIMITS",
        description="What a pool token of a pool the portal does not submit for itself (a Kubernetes DaemonSet's; "
        "the Slurm pool's agents are checked against its submissions) may register, as POOL:NODES:DEVICES, "
        "comma-separated (k8s:8:4: at most 8 nodes of pool k8s online, draining or unreachable at once, each "
        "with at most 4 devices). A pool not listed registers no node.",
    )
    liveness_file: Path | None = Field(
        None,
        validation_alias="BUNGEE_LIVENESS_FILE",
        description="The Celery worker and beat: a file touched at every turn of the main loop, for a probe "
        "(python -m elastic.liveness FILE --max-age S); unset: none is written.",
    )

    # --- the scheduler and the agents ------------------------------------------------------------
    schedule_tick_s: float = Field(
        5.0,
        gt=0,
        validation_alias="BUNGEE_SCHEDULE_TICK_S",
        description="How often the beat runs the scheduler even when nothing happened.",
    )
    report_interval_s: float = Field(
        1.0,
        gt=0,
        validation_alias="BUNGEE_REPORT_INTERVAL_S",
        description="How often agents report; the portal tells them at registration.",
    )
    node_timeout_s: float = Field(
        15.0,
        gt=0,
        validation_alias="BUNGEE_NODE_TIMEOUT_S",
        description="A node silent for this long is lost: its devices leave the pool.",
    )
    unreachable_timeout_s: float = Field(
        600.0,
        gt=0,
        validation_alias="BUNGEE_UNREACHABLE_TIMEOUT_S",
        description='A node whose agent is silent while its workers beat is "agent unreachable" (its workers '
        "train on); past this much silence it is lost all the same and its workers are told to leave.",
    )
    sample_history_every_s: float = Field(
        10.0,
        ge=0,
        validation_alias="BUNGEE_SAMPLE_HISTORY_EVERY_S",
        description="Device samples are kept in the database at most once per this many seconds per device.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        validation_alias="BUNGEE_MAX_RESTARTS",
        description="The restart budget (portal.jobs.restarts): a job whose workers fail more than this many "
        "times in a stretch is failed instead of restarted.",
    )
    restart_window_s: float = Field(
        600.0,
        gt=0,
        validation_alias="BUNGEE_RESTART_WINDOW_S",
        description="How long a failure counts against the restart budget.",
    )
    restart_healthy_s: float = Field(
        30.0,
        ge=0,
        validation_alias="BUNGEE_RESTART_HEALTHY_S",
        description="Training this long since the previous failure (with steps done) clears the restart count.",
    )
    publish_timeout_s: float = Field(
        60.0,
        gt=0,
        validation_alias="BUNGEE_PUBLISH_TIMEOUT_S",
        description="A generation's deadline from planned to published (portal.jobs.lifecycle, "
        "elastic.membership): the job's stopping workers must have exited (their agent gives them 30 s "
        "after SIGTERM, then kills them).",
    )
    warmup_timeout_s: float = Field(
        120.0,
        gt=0,
        validation_alias="BUNGEE_WARMUP_TIMEOUT_S",
        description="Published, a joiner not ready: its start-up (Python, torch, the model) must end; one still "
        "warming up is stopped and the job planned again without its device.",
    )
    form_timeout_s: float = Field(
        30.0,
        gt=0,
        validation_alias="BUNGEE_FORM_TIMEOUT_S",
        description="Published, every joiner ready: the group must form (a worker's rendezvous gives up after "
        "10 s and says so, which expires the generation at once; this is the bound if none can).",
    )
    settle_timeout_s: float = Field(
        60.0,
        gt=0,
        validation_alias="BUNGEE_SETTLE_TIMEOUT_S",
        description="Formed -> settled: leavers gone and rank 0's report in; leavers still there are stopped.",
    )
    master_port_base: int = Field(
        27600,
        ge=1,
        le=65535,
        validation_alias="BUNGEE_MASTER_PORT_BASE",
        description="First port of the range rendezvous ports are drawn from.",
    )
    redis_prefix: str = Field(
        "bungee",
        validation_alias="BUNGEE_REDIS_PREFIX",
        description="Redis key prefix, so that several deployments (or test runs) can share one Redis.",
    )
    policy: str = Field(
        "bungee",
        validation_alias="BUNGEE_POLICY",
        description="The scheduling policy, by name (elastic.scheduling.registry); a name it does not know stops "
        "every process at start (portal.scheduling.policy).",
    )
    resize_cost_s: float = Field(
        1.0,
        ge=0,
        validation_alias="BUNGEE_RESIZE_COST_S",
        description="What one resize costs a job, in seconds of its progress: the policy weighs every move "
        "against it. 1 s is the order of our in-place resize's pause; bench/resize.py measures it.",
    )

    # --- limits ------------------------------------------------------------------------------------
    login_address_failures: int = Field(
        20,
        ge=1,
        validation_alias="BUNGEE_LOGIN_ADDRESS_FAILURES",
        description="Failed logins from one address (an IPv6 /64) within a window opened by the first of them, "
        "past which its logins are answered 429 until the window ends (portal.accounts.login_throttle).",
    )
    login_address_window_s: int = Field(
        60,
        ge=1,
        validation_alias="BUNGEE_LOGIN_ADDRESS_WINDOW_S",
        description="The window of BUNGEE_LOGIN_ADDRESS_FAILURES, in seconds.",
    )
    decisions_kept: int = Field(
        50,
        ge=1,
        validation_alias="BUNGEE_DECISIONS_KEPT",
        description="How many scheduling decisions the admin page keeps.",
    )
    body_max_bytes: int = Field(
        1024 * 1024,
        ge=1,
        validation_alias="BUNGEE_BODY_MAX_BYTES",
        description="Any request body other than a code upload or artifacts (a JSON or YAML spec, a report, a "
        "form): refused with 413 above it.",
    )
    anonymous_body_max_bytes: int = Field(
        64 * 1024,
        ge=1,
        validation_alias="BUNGEE_ANONYMOUS_BODY_MAX_BYTES",
        description="A request body sent with no valid token or session (a login form): refused with 413 above it. "
        "An anonymous upload of code or artifacts is refused with 401 before any of it is read.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        validation_alias="BUNGEE_BODY_TIMEOUT_S",
        description="How long a request body may stall (no byte arriving), and how long a whole body may take beyond "
        "what BUNGEE_BODY_MIN_RATE_BYTES_S allows for its size: past it the request is answered 408 and its "
        "connection closed.",
    )
    body_min_rate_bytes_s: int = Field(
        256 * 1024,
        ge=1,
        validation_alias="BUNGEE_BODY_MIN_RATE_BYTES_S",
        description="The slowest average rate a request body may arrive at: a body of N bytes has "
        "BUNGEE_BODY_TIMEOUT_S plus N / this many seconds (a 20 GiB upload of artifacts at the default, 22 hours).",
    )
    code_max_bytes: int = Field(
        50 * 1024 * 1024,
        ge=1,
        validation_alias="BUNGEE_CODE_MAX_BYTES",
        description="A job's own code (elastic.codepack, kept by sha256 under DATA_DIR/code): the largest upload.",
    )
    code_max_unpacked_bytes: int = Field(
        200 * 1024 * 1024,
        ge=1,
        validation_alias="BUNGEE_CODE_MAX_UNPACKED_BYTES",
        description="What a job's code may unpack to.",
    )
    code_max_files: int = Field(
        10_000,
        ge=1,
        validation_alias="BUNGEE_CODE_MAX_FILES",
        description="How many files a job's code may hold.",
    )
    env_index_options: bool = Field(
        False,
        validation_alias="BUNGEE_ENV_INDEX_OPTIONS",
        description="Whether a job's requirements.txt may name where its packages come from (--index-url, "
        "--find-links, ...: elastic.requirements.INDEX_OPTIONS); the agents need the same setting.",
    )
    artifact_max_bytes: int = Field(
        20 * 1024**3,
        ge=1,
        validation_alias="BUNGEE_ARTIFACT_MAX_BYTES",
        description="A job's model, checkpoint and manifest (portal.jobs.artifacts, kept under "
        "DATA_DIR/artifacts): the largest upload of them an agent may send.",
    )
    artifact_retention_days: int = Field(
        30,
        ge=0,
        validation_alias="BUNGEE_ARTIFACT_RETENTION_DAYS",
        description="For how many days after the job's end its artifacts are kept (0: for ever).",
    )

    # --- history, pruned hourly by the beat and by `manage.py prunehistory` (portal.jobs.history) --
    metrics_full_steps: int = Field(
        10_000,
        ge=0,
        validation_alias="BUNGEE_METRICS_FULL_STEPS",
        description="A job's metrics stay as reported for its newest this many steps (and its last "
        "BUNGEE_METRICS_FULL_DAYS days).",
    )
    metrics_full_days: float = Field(
        2.0,
        ge=0,
        validation_alias="BUNGEE_METRICS_FULL_DAYS",
        description="A job's metrics stay as reported for its last this many days (and its newest "
        "BUNGEE_METRICS_FULL_STEPS steps).",
    )
    metrics_old_points: int = Field(
        4000,
        ge=0,
        validation_alias="BUNGEE_METRICS_OLD_POINTS",
        description="Older metrics are thinned to about this many rows a job (0: never thinned).",
    )
    device_samples_full_hours: float = Field(
        24.0,
        ge=0,
        validation_alias="BUNGEE_DEVICE_SAMPLES_FULL_HOURS",
        description="Device samples stay as taken for this many hours (the API serves a day back).",
    )
    device_samples_bucket_s: int = Field(
        300,
        ge=1,
        validation_alias="BUNGEE_DEVICE_SAMPLES_BUCKET_S",
        description="Older device samples are kept as one per device per this many seconds, the mean of its "
        "samples.",
    )
    device_samples_keep_days: float = Field(
        30.0,
        ge=0,
        validation_alias="BUNGEE_DEVICE_SAMPLES_KEEP_DAYS",
        description="No device sample is kept past this many days (0: kept for ever).",
    )
    pool_node_retention_hours: float = Field(
        24.0,
        ge=0,
        validation_alias="BUNGEE_POOL_NODE_RETENTION_HOURS",
        description="A node that a pool registered (a Slurm agent job, a Kubernetes pod), drained or lost and "
        "unheard of for this many hours, is deleted with its devices and its agent token; job history "
        "keeps its name (0: kept for ever).",
    )
    log_retention_days: float = Field(
        30.0,
        ge=0,
        validation_alias="BUNGEE_LOG_RETENTION_DAYS",
        description="The logs of jobs that ended more than this many days ago (0: kept for ever) are cut to "
        "their last BUNGEE_LOG_LINES_KEPT lines.",
    )
    log_lines_kept: int = Field(
        1000,
        ge=0,
        validation_alias="BUNGEE_LOG_LINES_KEPT",
        description="The lines an old job's log is cut to (0: deleted).",
    )

    @field_validator("allowed_hosts", "csrf_trusted_origins", "forwarded_allow_ips", "pool_limits", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("forwarded_allow_ips", mode="after")
    @classmethod
    def _addresses_or_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry == "*":
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (give the reverse proxy's addresses, "
                    "comma-separated, or '*' for any)"
                ) from None
        return value

    @field_validator("pool_limits", mode="after")
    @classmethod
    def _pool_limits(cls, value: list[str]) -> list[str]:
        for entry in value:
            pool, nodes, devices = ([*entry.split(":"), "", ""])[:3]
            if entry.count(":") != 2 or not re.fullmatch(POOL_NAME_PATTERN, pool) or not (
                nodes.isdigit() and devices.isdigit() and int(nodes) >= 1 and int(devices) >= 1
            ):
                raise ValueError(
                    f"{entry!r} is not POOL:NODES:DEVICES (a pool's name, then how many of its nodes at once and "
                    "how many devices each, both at least 1; e.g. k8s:8:4)"
                )
        return value

    def pool_limit(self, pool: str) -> tuple[int, int] | None:
        """(most nodes, most devices a node) BUNGEE_POOL_LIMITS sets for `pool`, or None."""
        for entry in self.pool_limits:
            name, nodes, devices = entry.split(":")
            if name == pool:
                return int(nodes), int(devices)
        return None

    @field_validator("data_dir", mode="after")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.resolve()

    @property
    def run_dir(self) -> Path:
        """Where jobs keep their periodic checkpoint (shared by agents on one machine)."""
        return self.data_dir / "runs"

    @property
    def code_dir(self) -> Path:
        """Where jobs' code is kept, by sha256."""
        return self.data_dir / "code"

    @property
    def artifact_dir(self) -> Path:
        """Where jobs' artifacts are kept, job-N for each job."""
        return self.data_dir / "artifacts"


class SlurmPoolSettings(EnvironSettings):
    """Bungee's Slurm pool (portal.slurm): agents submitted as Slurm batch jobs when jobs want more
    devices than the cluster has, cancelled when idle. Off by default; when on,
    portal.slurm.config.pool_config checks that the values can work together."""

    enabled: bool = Field(False, validation_alias="BUNGEE_SLURM_ENABLED", description="Run the pool at all.")
    pool: str = Field(
        "slurm",
        validation_alias="BUNGEE_SLURM_POOL",
        description="The pool's name: its agents' nodes are named POOL-NODE-jobID, the names its pool token "
        "(create_token --role pool --pool POOL) may register.",
    )
    partition: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_PARTITION",
        description="Where agent jobs are submitted (sbatch --partition); unset: the cluster's default.",
    )
    account: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_ACCOUNT",
        description="sbatch --account; unset: the cluster's default.",
    )
    qos: str = Field(
        "", validation_alias="BUNGEE_SLURM_QOS", description="sbatch --qos; unset: the cluster's default."
    )
    gres: str = Field(
        "gpu:1",
        validation_alias="BUNGEE_SLURM_GRES",
        description="What one agent job asks for (--gres), NAME[:TYPE]:COUNT.",
    )
    devices_per_agent: int = Field(
        0,
        ge=0,
        validation_alias="BUNGEE_SLURM_DEVICES_PER_AGENT",
        description="Devices one agent brings; with a gres other than gpu, passed to it as --devices (Slurm tells "
        "a job nothing of such a gres); 0: the gres count.",
    )
    time_limit: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_TIME_LIMIT",
        description="--time, in Slurm's forms (minutes, H:MM:SS, D-HH, ...); unset: the partition's.",
    )
    grace_s: int = Field(
        120,
        ge=1,
        validation_alias="BUNGEE_SLURM_GRACE_S",
        description="--signal=B:TERM@GRACE: the agent drains from GRACE seconds before its time limit (and, "
        "where the cluster sets preempt_send_user_signal, when it is preempted).",
    )
    max_agents: int = Field(
        4,
        ge=0,
        validation_alias="BUNGEE_SLURM_MAX_AGENTS",
        description="The most agent jobs at once, pending or running; one whose node drains (preempted, at its "
        "time limit) is not counted.",
    )
    idle_s: float = Field(
        600.0,
        validation_alias="BUNGEE_SLURM_IDLE_S",
        description="An agent whose node held no job for this long is cancelled, if the cluster can spare its "
        "devices.",
    )
    start_timeout_s: float = Field(
        600.0,
        validation_alias="BUNGEE_SLURM_START_TIMEOUT_S",
        description="An agent job running this long without its node registering is cancelled (reported as an "
        "error).",
    )
    agent_args: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_AGENT_ARGS",
        description="More agent flags (shell words); unset: none.",
    )
    sbatch_args: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_SBATCH_ARGS",
        description="More sbatch options (shell words); unset: none.",
    )
    portal_url: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_PORTAL_URL",
        description="The portal's URL as the agents reach it; required when the pool is on.",
    )
    token_file: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_TOKEN_FILE",
        description="The pool's agent credential, a file the agents read on the compute node; required when the "
        "pool is on.",
    )
    python: str = Field(
        "python3",
        validation_alias="BUNGEE_SLURM_PYTHON",
        description="The interpreter that runs `-m agent` on the compute node.",
    )
    workdir: Path = Field(
        BASE_DIR,
        validation_alias="BUNGEE_SLURM_WORKDIR",
        description="--chdir: where `agent` is importable on the compute node.",
    )
    output: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_OUTPUT",
        description="--output of agent jobs (a shared file system: the portal makes the folder); unset: "
        "DATA_DIR/slurm/%x-%j.out.",
    )
    agent_data_dir: str = Field(
        "",
        validation_alias="BUNGEE_SLURM_AGENT_DATA_DIR",
        description="BUNGEE_DATA_DIR of agent jobs, set by their batch script: each keeps its state in "
        "AGENT_DATA_DIR/agent/slurm-HOST-jobID (and removes it when it drains and leaves); a node's local "
        "scratch will do. Unset: the portal's DATA_DIR.",
    )
    export: str = Field(
        "NONE",
        validation_alias="BUNGEE_SLURM_EXPORT",
        description="--export: NONE gives the agent the submitting user's login environment, never the portal's "
        "secrets.",
    )
    job_name: str = Field(
        "bungee-agent",
        validation_alias="BUNGEE_SLURM_JOB_NAME",
        description="The pool's jobs are those of this name and the portal's user.",
    )
    every_s: float = Field(
        15.0, validation_alias="BUNGEE_SLURM_EVERY_S", description="How often the beat sizes the pool."
    )
    on_demand: bool = Field(
        True,
        validation_alias="BUNGEE_SLURM_ON_DEMAND",
        description="Also size the pool at once when demand appears (a job submitted or queued again, a resize "
        "asking for more, a node draining, drained or lost, a device's owner back); off: on the beat only.",
    )
    command_timeout_s: float = Field(
        30.0,
        validation_alias="BUNGEE_SLURM_COMMAND_TIMEOUT_S",
        description="The longest a Slurm command may take.",
    )


class DemoSettings(EnvironSettings):
    """`make demo` (portal.demo): the platform on one machine. It reads PortalSettings too (the
    data directory, the Celery queue, whether SECRET_KEY and REDIS_URL are set)."""

    port: int = Field(
        8000, ge=1, le=65535, validation_alias="PORT", description="`make demo`: the portal's port (--port)."
    )
    devices: int = Field(
        4,
        ge=1,
        validation_alias="BUNGEE_SIM_DEVICES",
        description="`make demo`: simulated devices on the demo node (--devices).",
    )


Settings = TypeVar("Settings", bound=EnvironSettings)


def load_settings(cls: type[Settings], environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of class `cls` from `environ` (None: os.environ). Raises
    ImproperlyConfigured, quoting each bad value with its variable."""
    try:
        return cls.from_environ(environ)
    except SettingsError as err:
        raise ImproperlyConfigured(str(err)) from None
