"""`GET /healthz` and `GET /readyz`: the probes of whatever supervises a portal process (Kubernetes'
kubelet, a load balancer). Unauthenticated, outside /api (not part of the API's document), and
saying nothing about the deployment beyond "ok" or which store did not answer.

- /healthz, liveness: the process answers HTTP. It touches neither the database nor Redis, so
  that an outage of either never restarts portals, which could do nothing about it.
- /readyz, readiness: the database and Redis each answer one round trip within READY_TIMEOUT_S;
  otherwise 503 in the API's error shape with Retry-After, and the supervisor sends no new
  requests here until they do. Each check runs in a thread of its own and the request waits for
  it at most READY_TIMEOUT_S: a store that hangs (no answer rather than a refusal) would hold a
  request for as long as the store's own timeouts allow (BUNGEE_DB_POOL_TIMEOUT_S, 10 s). A check
  still running when the next probe comes is waited on again, not started twice, so a hung store
  costs one thread per store, not one per probe."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from portal.error_pages import RETRY_AFTER_S
from portal.errors import ApiError
from portal.redis import client

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0
"""How long /readyz waits for the stores to answer; below the probe's own timeout (5 s)."""

_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="readyz")
_running: dict[str, Future[None]] = {}
_lock = threading.Lock()


def _database() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        # This thread's connection: back to the pool (PostgreSQL) or closed, not left to the thread.
        connection.close()


def _redis() -> None:
    client().ping()


CHECKS: dict[str, Callable[[], None]] = {"database": _database, "Redis": _redis}


def _check(store: str) -> Future[None]:
    """The check of `store` in flight, or a new one if none is."""
    with _lock:
        running = _running.get(store)
        if running is None or running.done():
            running = _running[store] = _executor.submit(CHECKS[store])
        return running


@require_safe
def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@require_safe
def readyz(request: HttpRequest) -> HttpResponse:
    checks = {store: _check(store) for store in CHECKS}
    wait(checks.values(), timeout=READY_TIMEOUT_S)
    problems = []
    for store, check in checks.items():
        if not check.done():
            problems.append(f"the portal's {store} did not answer within {READY_TIMEOUT_S:g} s")
        elif check.exception() is not None:
            # What failed stays in the log: the error names hosts, ports and databases.
            log.warning("/readyz: the portal's %s is not answering: %s", store, check.exception())
            problems.append(f"the portal's {store} is not answering")
    if not problems:
        return JsonResponse({"status": "ready"})
    response = JsonResponse(ApiError(503, "unavailable", "; ".join(problems)).body(), status=503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response
