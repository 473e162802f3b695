"""Django settings for the Bungee portal. Everything comes from the environment (every setting:
docs/reference/configuration.md); the defaults make a laptop run work with no configuration at all."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from portal.env import env_bool, env_float, env_int, env_list, env_str
from portal.live.redis_connection import layer_host

BASE_DIR = Path(__file__).resolve().parent.parent
# Where the portal keeps its files: the SQLite database, logs, job checkpoints (runs/), code and
# artifacts.
DATA_DIR = Path(env_str("BUNGEE_DATA_DIR", str(BASE_DIR / "var"))).resolve()

# With DEBUG off the portal refuses this default (portal.secrets_check); `make demo` makes its own.
SECRET_KEY = env_str("SECRET_KEY", "bungee-development-key-change-me-in-production")
# Django's debug pages; never in production.
DEBUG = env_bool("DEBUG", False)
# The host names the portal answers to, comma-separated.
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
# The origins (scheme and host) from which forms may be posted, comma-separated: the portal's own
# address as browsers see it behind a proxy that changes it.
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # django-ninja's own copy of Swagger UI, served from here: /api/docs works with no internet
    # (without the app in this list ninja's page loads Swagger UI from a CDN).
    "ninja",
    "channels",
    "portal.accounts",
    "portal.cluster",
    "portal.jobs",
    "portal.live",
    "portal.scheduling",
    "portal.slurm",
    "axes",
]

# Password guessing (portal.accounts.login_throttle): django-axes locks a user after
# BUNGEE_LOGIN_FAILURE_LIMIT failed logins, from any address, for BUNGEE_LOGIN_COOLOFF_MIN
# minutes from the failure that locked it (failures during the lock do not extend it, or anyone
# could keep a user locked with one guess a quarter of an hour); the page says how to lift it
# (templates/login_locked.html). A lock on (user, address) as well would add nothing: a user's
# failures from one address are among its failures from all. An address is never locked out,
# since many people may share one behind a proxy or a NAT: past BUNGEE_LOGIN_ADDRESS_FAILURES
# failed logins within BUNGEE_LOGIN_ADDRESS_WINDOW_S it is answered 429 with Retry-After for the
# rest of that window. The address is REMOTE_ADDR alone (what the ASGI server took from a trusted
# proxy), never a header the client sends: axes asks our function, so an installed django-ipware
# is not consulted. API tokens are not passwords (random, 256 bits): they do not count.
AUTHENTICATION_BACKENDS = [
    "portal.accounts.login_throttle.LoginThrottleBackend",
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Failed logins for one user, from any address, before that user is locked.
AXES_FAILURE_LIMIT = env_int("BUNGEE_LOGIN_FAILURE_LIMIT", 5, minimum=1)
# Minutes a locked user stays locked, from the failure that locked it.
AXES_COOLOFF_TIME = timedelta(minutes=env_int("BUNGEE_LOGIN_COOLOFF_MIN", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = ["username"]
# axes warns (W006) of a lock without the address: one by user agent or cookie could be dodged by
# changing them. A lock by user cannot, and the address has its own throttle.
SILENCED_SYSTEM_CHECKS = ["axes.W006"]
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "portal.accounts.login_throttle.client_address"
AXES_HANDLER = "portal.accounts.login_throttle.AxesHandler"
AXES_LOCKOUT_TEMPLATE = "login_locked.html"

MIDDLEWARE = [
    "portal.error_pages.ApiErrorShape",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",
    "portal.accounts.login_throttle.ThrottledLoginResponse",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# The database, as a URL (PostgreSQL in production: postgres://USER:PASSWORD@HOST:PORT/NAME).
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'bungee.sqlite3'}")
try:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
except Exception as exc:  # dj_database_url raises several types for a malformed URL
    raise ImproperlyConfigured(f"DATABASE_URL={DATABASE_URL!r} is not a database URL: {exc}") from exc
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (portal, worker, beat) write to one file: wait for the lock, don't fail.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
elif DATABASES["default"]["ENGINE"].endswith("postgresql"):
    # A pool of connections per process, shared by its threads (psycopg_pool, through Django).
    # Persistent connections are per thread, and the ASGI portal runs its sync views and
    # consumers in many: one portal held 15 idle connections, and two platforms side by side
    # met PostgreSQL's max_connections (100) and answered 500. Django's docs say as much:
    # under ASGI, pool instead of persistent connections.
    # The pool checks a connection before handing it out (one round trip): after PostgreSQL
    # restarted, or ended the portal's sessions, a request gets a live connection, not a dead one.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        # PostgreSQL only: the most connections each process (portal, Celery worker, beat) holds.
        "max_size": env_int("BUNGEE_DB_POOL_SIZE", 8),
        # PostgreSQL only: how long a request waits for one of them, in seconds.
        "timeout": env_float("BUNGEE_DB_POOL_TIMEOUT_S", 10.0),
        # A connection that cannot be made is tried again after 1, 2 and 2 s, then given up on
        # (psycopg_pool's backoff, cut short): the next request tries at once. With the default
        # (5 min, the waits doubling), a portal could answer 503 for minutes after the database
        # came back.
        "reconnect_timeout": 5.0,
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns about a missing STATIC_ROOT
# WhiteNoise serves static files from the ASGI process itself; without collectstatic it finds
# them where they are, so `make demo` needs no extra step.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# --- Redis: Celery broker, Channels layer, agent command streams, live metrics --------------
# The Redis of the Celery broker, the Channels layer, the agents' command streams and live metrics.
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")

# A socket's channel waits for its next message with a blocking pop of 5 s; redis-py 8 reads with
# a 5 s socket timeout by default, so a socket that heard nothing for 5 s failed with "Timeout
# reading" (a traceback in the log, and the browser dropped with 1011). Reads get 5 s beyond the
# pop; connecting stays quick.
# Its connections bound a write with a deadline that a cancellation still ends (redis_connection).
CHANNEL_LAYER_TIMEOUTS = {"socket_timeout": 10, "socket_connect_timeout": 2}
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [layer_host(REDIS_URL, **CHANNEL_LAYER_TIMEOUTS)],
            # The Channels layer's key prefix, so that deployments can share a Redis.
            "prefix": env_str("BUNGEE_CHANNEL_PREFIX", "bungee"),
            # A socket that is gone without leaving its groups (the portal was killed) drops out
            # of them after this; a live one renews its membership well before (portal.live).
            "group_expiry": env_int("BUNGEE_SOCKET_GROUP_EXPIRY_S", 120),
        },
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# The Celery queue of the portal's tasks, so that deployments can share a Redis.
CELERY_TASK_DEFAULT_QUEUE = env_str("BUNGEE_CELERY_QUEUE", "bungee")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Sending a task while Redis is away fails within seconds (the request goes on; the beat's tick
# or the next event asks again) instead of retrying for as long as the broker takes to return.
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 1, "socket_timeout": 2, "max_retries": 1}
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}
# A Celery worker whose broker went away consumes again once it is back (celery#8030-style
# stalls): it retries its connection without end.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None

# --- Bungee ----------------------------------------------------------------------------------
class BungeeSettings(TypedDict):
    """The types of settings.BUNGEE's entries (what each means: the comments on BUNGEE below)."""

    SCHEDULE_TICK_S: float
    REPORT_INTERVAL_S: float
    NODE_TIMEOUT_S: float
    UNREACHABLE_TIMEOUT_S: float
    SAMPLE_HISTORY_EVERY_S: float
    MAX_RESTARTS: int
    RESTART_WINDOW_S: float
    RESTART_HEALTHY_S: float
    PUBLISH_TIMEOUT_S: float
    WARMUP_TIMEOUT_S: float
    FORM_TIMEOUT_S: float
    SETTLE_TIMEOUT_S: float
    RUN_DIR: str
    MASTER_PORT_BASE: int
    REDIS_PREFIX: str
    POLICY: str
    RESIZE_COST_S: float
    LOGIN_ADDRESS_FAILURES: int
    LOGIN_ADDRESS_WINDOW_S: int
    DECISIONS_KEPT: int
    BODY_MAX_BYTES: int
    CODE_MAX_BYTES: int
    CODE_MAX_UNPACKED_BYTES: int
    CODE_MAX_FILES: int
    ENV_INDEX_OPTIONS: bool
    CODE_DIR: str
    ARTIFACT_DIR: str
    ARTIFACT_MAX_BYTES: int
    ARTIFACT_RETENTION_DAYS: int
    METRICS_FULL_STEPS: int
    METRICS_FULL_DAYS: float
    METRICS_OLD_POINTS: int
    DEVICE_SAMPLES_FULL_HOURS: float
    DEVICE_SAMPLES_BUCKET_S: int
    DEVICE_SAMPLES_KEEP_DAYS: float
    LOG_RETENTION_DAYS: float
    LOG_LINES_KEPT: int


BUNGEE: BungeeSettings = {
    # How often the beat runs the scheduler even when nothing happened.
    "SCHEDULE_TICK_S": env_float("BUNGEE_SCHEDULE_TICK_S", 5.0),
    # How often agents report; the portal tells them at registration.
    "REPORT_INTERVAL_S": env_float("BUNGEE_REPORT_INTERVAL_S", 1.0),
    # A node silent for this long is lost: its devices leave the pool.
    "NODE_TIMEOUT_S": env_float("BUNGEE_NODE_TIMEOUT_S", 15.0),
    # A node whose agent is silent while its workers beat is "agent unreachable" (its workers
    # train on); past this much silence it is lost all the same and its workers are told to leave.
    "UNREACHABLE_TIMEOUT_S": env_float("BUNGEE_UNREACHABLE_TIMEOUT_S", 600.0),
    # Device samples are kept in the database at most once per this many seconds per device.
    "SAMPLE_HISTORY_EVERY_S": env_float("BUNGEE_SAMPLE_HISTORY_EVERY_S", 10.0),
    # The restart budget (portal.jobs.restarts): a job whose workers fail more than MAX_RESTARTS
    # times in a stretch is failed instead of restarted; a failure counts for RESTART_WINDOW_S,
    # and training RESTART_HEALTHY_S since the previous failure (with steps done) clears the count.
    "MAX_RESTARTS": env_int("BUNGEE_MAX_RESTARTS", 3),
    "RESTART_WINDOW_S": env_float("BUNGEE_RESTART_WINDOW_S", 600.0),
    "RESTART_HEALTHY_S": env_float("BUNGEE_RESTART_HEALTHY_S", 30.0),
    # The deadlines of a generation's phases (portal.jobs.lifecycle, elastic.membership).
    # Planned -> published: the job's stopping workers must have exited (their agent gives
    # them 30 s after SIGTERM, then kills them).
    "PUBLISH_TIMEOUT_S": env_float("BUNGEE_PUBLISH_TIMEOUT_S", 60.0),
    # Published, a joiner not ready: its start-up (Python, torch, the model) must end; one
    # still warming up is stopped and the job planned again without its device.
    "WARMUP_TIMEOUT_S": env_float("BUNGEE_WARMUP_TIMEOUT_S", 120.0),
    # Published, every joiner ready: the group must form (a worker's rendezvous gives up after
    # 10 s and says so, which expires the generation at once; this is the bound if none can).
    "FORM_TIMEOUT_S": env_float("BUNGEE_FORM_TIMEOUT_S", 30.0),
    # Formed -> settled: leavers gone and rank 0's report in; leavers still there are stopped.
    "SETTLE_TIMEOUT_S": env_float("BUNGEE_SETTLE_TIMEOUT_S", 60.0),
    # Where jobs keep their periodic checkpoint (shared by agents on one machine).
    "RUN_DIR": str(DATA_DIR / "runs"),
    # First port of the range rendezvous ports are drawn from.
    "MASTER_PORT_BASE": env_int("BUNGEE_MASTER_PORT_BASE", 27600),
    # Redis key prefix, so that several deployments (or test runs) can share one Redis.
    "REDIS_PREFIX": env_str("BUNGEE_REDIS_PREFIX", "bungee"),
    # The scheduling policy, by name (elastic.scheduling.registry); a name it does not know
    # stops every process at start (portal.scheduling.policy).
    "POLICY": env_str("BUNGEE_POLICY", "bungee"),
    # What one resize costs a job, in seconds of its progress: the policy weighs every move
    # against it. 1 s is the order of our in-place resize's pause; bench/resize.py measures it.
    "RESIZE_COST_S": env_float("BUNGEE_RESIZE_COST_S", 1.0),
    # Failed logins from one address (an IPv6 /64) within a window opened by the first of them,
    # past which its logins are answered 429 until the window ends (portal.accounts.login_throttle).
    "LOGIN_ADDRESS_FAILURES": env_int("BUNGEE_LOGIN_ADDRESS_FAILURES", 20, minimum=1),
    "LOGIN_ADDRESS_WINDOW_S": env_int("BUNGEE_LOGIN_ADDRESS_WINDOW_S", 60, minimum=1),
    # How many scheduling decisions the admin page keeps.
    "DECISIONS_KEPT": env_int("BUNGEE_DECISIONS_KEPT", 50),
    # Any request body other than a code upload or artifacts (a JSON or YAML spec, a report, a
    # form): refused with 413 above it.
    "BODY_MAX_BYTES": env_int("BUNGEE_BODY_MAX_BYTES", 1024 * 1024),
    # A job's own code (elastic.codepack): the largest upload, what it may unpack to, how many
    # files, and where the portal keeps it (by sha256).
    "CODE_MAX_BYTES": env_int("BUNGEE_CODE_MAX_BYTES", 50 * 1024 * 1024),
    "CODE_MAX_UNPACKED_BYTES": env_int("BUNGEE_CODE_MAX_UNPACKED_BYTES", 200 * 1024 * 1024),
    "CODE_MAX_FILES": env_int("BUNGEE_CODE_MAX_FILES", 10_000),
    # Whether a job's requirements.txt may name where its packages come from (--index-url,
    # --find-links, ...: elastic.requirements.INDEX_OPTIONS); the agents need the same setting.
    "ENV_INDEX_OPTIONS": env_bool("BUNGEE_ENV_INDEX_OPTIONS", False),
    "CODE_DIR": str(DATA_DIR / "code"),
    # A job's model, checkpoint and manifest (portal.jobs.artifacts): where they are kept, the
    # largest upload of them an agent may send, and for how many days after the job's end
    # (0: for ever).
    "ARTIFACT_DIR": str(DATA_DIR / "artifacts"),
    "ARTIFACT_MAX_BYTES": env_int("BUNGEE_ARTIFACT_MAX_BYTES", 20 * 1024**3),
    "ARTIFACT_RETENTION_DAYS": env_int("BUNGEE_ARTIFACT_RETENTION_DAYS", 30),
    # History, pruned hourly by the beat and by `manage.py prunehistory` (portal.jobs.history).
    # A job's metrics stay as reported for its newest METRICS_FULL_STEPS steps and its last
    # METRICS_FULL_DAYS days; older ones are thinned to about METRICS_OLD_POINTS rows a job
    # (0: never thinned).
    "METRICS_FULL_STEPS": env_int("BUNGEE_METRICS_FULL_STEPS", 10_000),
    "METRICS_FULL_DAYS": env_float("BUNGEE_METRICS_FULL_DAYS", 2.0),
    "METRICS_OLD_POINTS": env_int("BUNGEE_METRICS_OLD_POINTS", 4000),
    # Device samples stay as taken for DEVICE_SAMPLES_FULL_HOURS (the API serves a day back),
    # then one per device per DEVICE_SAMPLES_BUCKET_S, the mean of its samples; none past
    # DEVICE_SAMPLES_KEEP_DAYS (0: kept for ever).
    "DEVICE_SAMPLES_FULL_HOURS": env_float("BUNGEE_DEVICE_SAMPLES_FULL_HOURS", 24.0),
    "DEVICE_SAMPLES_BUCKET_S": env_int("BUNGEE_DEVICE_SAMPLES_BUCKET_S", 300),
    "DEVICE_SAMPLES_KEEP_DAYS": env_float("BUNGEE_DEVICE_SAMPLES_KEEP_DAYS", 30.0),
    # The logs of jobs that ended more than LOG_RETENTION_DAYS ago (0: kept for ever) are cut
    # to their last LOG_LINES_KEPT lines (0: deleted).
    "LOG_RETENTION_DAYS": env_float("BUNGEE_LOG_RETENTION_DAYS", 30.0),
    "LOG_LINES_KEPT": env_int("BUNGEE_LOG_LINES_KEPT", 1000),
}


class SlurmSettings(TypedDict):
    """The types of settings.BUNGEE_SLURM's entries (portal.slurm.config checks their values)."""

    ENABLED: bool
    POOL: str
    PARTITION: str
    ACCOUNT: str
    QOS: str
    GRES: str
    DEVICES_PER_AGENT: int
    TIME_LIMIT: str
    GRACE_S: int
    MAX_AGENTS: int
    IDLE_S: float
    START_TIMEOUT_S: float
    AGENT_ARGS: str
    SBATCH_ARGS: str
    PORTAL_URL: str
    TOKEN_FILE: str
    PYTHON: str
    WORKDIR: str
    OUTPUT: str
    EXPORT: str
    JOB_NAME: str
    EVERY_S: float
    COMMAND_TIMEOUT_S: float


# Bungee's Slurm pool (portal.slurm): agents submitted as Slurm batch jobs when jobs want more
# devices than the cluster has, cancelled when idle. Off by default; read and checked by
# portal.slurm.config, which says what each one means.
BUNGEE_SLURM: SlurmSettings = {
    "ENABLED": env_bool("BUNGEE_SLURM_ENABLED", False),
    "POOL": env_str("BUNGEE_SLURM_POOL", "slurm"),
    "PARTITION": env_str("BUNGEE_SLURM_PARTITION", ""),
    "ACCOUNT": env_str("BUNGEE_SLURM_ACCOUNT", ""),
    "QOS": env_str("BUNGEE_SLURM_QOS", ""),
    "GRES": env_str("BUNGEE_SLURM_GRES", "gpu:1"),
    "DEVICES_PER_AGENT": env_int("BUNGEE_SLURM_DEVICES_PER_AGENT", 0, minimum=0),
    "TIME_LIMIT": env_str("BUNGEE_SLURM_TIME_LIMIT", ""),
    "GRACE_S": env_int("BUNGEE_SLURM_GRACE_S", 120, minimum=1),
    "MAX_AGENTS": env_int("BUNGEE_SLURM_MAX_AGENTS", 4, minimum=0),
    "IDLE_S": env_float("BUNGEE_SLURM_IDLE_S", 600.0),
    "START_TIMEOUT_S": env_float("BUNGEE_SLURM_START_TIMEOUT_S", 600.0),
    "AGENT_ARGS": env_str("BUNGEE_SLURM_AGENT_ARGS", ""),
    "SBATCH_ARGS": env_str("BUNGEE_SLURM_SBATCH_ARGS", ""),
    "PORTAL_URL": env_str("BUNGEE_SLURM_PORTAL_URL", ""),
    "TOKEN_FILE": env_str("BUNGEE_SLURM_TOKEN_FILE", ""),
    "PYTHON": env_str("BUNGEE_SLURM_PYTHON", "python3"),
    "WORKDIR": env_str("BUNGEE_SLURM_WORKDIR", str(BASE_DIR)),
    "OUTPUT": env_str("BUNGEE_SLURM_OUTPUT", str(DATA_DIR / "slurm" / "%x-%j.out")),
    "EXPORT": env_str("BUNGEE_SLURM_EXPORT", "NONE"),
    "JOB_NAME": env_str("BUNGEE_SLURM_JOB_NAME", "bungee-agent"),
    "EVERY_S": env_float("BUNGEE_SLURM_EVERY_S", 15.0),
    "COMMAND_TIMEOUT_S": env_float("BUNGEE_SLURM_COMMAND_TIMEOUT_S", 30.0),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A 4xx is logged as one line (Django adds a 403's traceback): portal.error_pages.
    "filters": {"one_line_refusals": {"()": "portal.error_pages.OneLineRefusals"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["one_line_refusals"]}},
    # The portal's logging level: DEBUG, INFO, WARNING or ERROR.
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
