"""Django settings for the Bungee portal. Everything comes from the environment, read once into
BUNGEE (portal.config.PortalSettings: every setting's type, default, bounds, variable and meaning;
docs/reference/configuration.md lists them); the defaults make a laptop run work with no
configuration at all."""

from __future__ import annotations

from datetime import timedelta

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from portal.config import BASE_DIR, PortalSettings, SlurmPoolSettings, load_settings
from portal.live.redis_connection import layer_host

# The portal's own settings, typed: code reads settings.BUNGEE.node_timeout_s and the like.
BUNGEE: PortalSettings = load_settings(PortalSettings)
DATA_DIR = BUNGEE.data_dir

SECRET_KEY = BUNGEE.secret_key
DEBUG = BUNGEE.debug
ALLOWED_HOSTS = BUNGEE.allowed_hosts
CSRF_TRUSTED_ORIGINS = BUNGEE.csrf_trusted_origins

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
AXES_FAILURE_LIMIT = BUNGEE.login_failure_limit
AXES_COOLOFF_TIME = timedelta(minutes=BUNGEE.login_cooloff_min)
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

DATABASE_URL = BUNGEE.database_url or f"sqlite:///{DATA_DIR / 'bungee.sqlite3'}"
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
        "max_size": BUNGEE.db_pool_size,
        "timeout": BUNGEE.db_pool_timeout_s,
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
REDIS_URL = BUNGEE.redis_url

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
            "prefix": BUNGEE.channel_prefix,
            "group_expiry": BUNGEE.socket_group_expiry_s,
        },
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = BUNGEE.celery_queue
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Sending a task while Redis is away fails within seconds (the request goes on; the beat's tick
# or the next event asks again) instead of retrying for as long as the broker takes to return.
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 1, "socket_timeout": 2, "max_retries": 1}
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}
# A Celery worker whose broker went away consumes again once it is back (celery#8030-style
# stalls): it retries its connection without end.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None


# Bungee's Slurm pool (portal.slurm), off by default: what each setting means is in
# portal.config.SlurmPoolSettings; portal.slurm.config checks them when the pool is on.
BUNGEE_SLURM: SlurmPoolSettings = load_settings(SlurmPoolSettings)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A 4xx is logged as one line (Django adds a 403's traceback): portal.error_pages.
    "filters": {"one_line_refusals": {"()": "portal.error_pages.OneLineRefusals"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["one_line_refusals"]}},
    "root": {"handlers": ["console"], "level": BUNGEE.log_level},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
