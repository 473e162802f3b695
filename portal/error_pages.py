"""Error replies. Every error reply under /api/ has the API's error shape (portal.errors), also
those Django makes before or outside the API's views: no URL matched (404), a method the URL does
not take (405), a body Django refused to read (400), a server error (500). The status and its
headers (Allow) are kept; the HTML or plain text becomes the JSON shape.

A store that does not answer is no fault of the request: Redis away (after redis-py's bounded
retries) or the database away (PostgreSQL refusing or down, or no pooled connection free within
BUNGEE_DB_POOL_TIMEOUT_S: Django's OperationalError) is a 503 with Retry-After, in the API's shape
under /api/ and as the site's page elsewhere. The request changed nothing: a view's transaction
rolls back with the error. The live socket is refused the same way, with its own close code
(portal.live.unavailable).

A person's 403 and 404 are the site's page (header and navigation) saying why; and a refusal is
logged as one line, not as a traceback (`OneLineRefusals`)."""

from __future__ import annotations

import logging

import redis
from django.core.exceptions import PermissionDenied
from django.db import OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.deprecation import MiddlewareMixin

from portal.errors import ApiError

log = logging.getLogger(__name__)

_CODES = {400: "bad_request", 403: "forbidden", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
          415: "unsupported_media_type", 500: "server_error"}


def _message(request: HttpRequest, status: int) -> str:
    if status == 404:
        return f"no API endpoint at {request.path}; the operations are listed at /api/docs"
    if status == 405:
        return f"{request.method} is not allowed on {request.path}"
    if status == 500:
        return "the server failed on this request; it is logged"
    return f"the request was refused ({status})"


RETRY_AFTER_S = 5
"""What a 503 asks the client to wait before trying again."""


def unavailable_store(exception: BaseException) -> str | None:
    """Which store did not answer ("Redis", "database"), if `exception` says one did; else None.
    The live socket refuses on the same (portal.live.unavailable)."""
    if isinstance(exception, redis.ConnectionError | redis.TimeoutError):
        return "Redis"
    if isinstance(exception, OperationalError):
        return "database"
    return None


class ApiErrorShape(MiddlewareMixin):
    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """A store away: 503 with Retry-After, at once (see the module docstring)."""
        store = unavailable_store(exception)
        if store is None:
            return None
        # What failed stays in the log: the error names hosts, ports and databases, and this reply
        # goes to anyone, also before they are authenticated.
        log.warning("%s %s: 503, the portal's %s is not answering: %s", request.method, request.path, store, exception)
        message = f"the portal's {store} is not answering; try again shortly"
        response: HttpResponse
        if request.path.startswith("/api/"):
            response = JsonResponse(ApiError(503, "unavailable", message).body(), status=503)
        else:
            # The page asks nothing of the session or the user: both live in the database. (Imported
            # here: settings' LOGGING imports this module before the apps are ready.)
            from django.contrib.auth.models import AnonymousUser

            context = {"heading": "Unavailable", "reason": message, "user": AnonymousUser()}
            response = render(request, "error.html", context, status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if (
            not request.path.startswith("/api/")
            or response.status_code < 400
            or response.get("Content-Type", "").startswith("application/json")
        ):
            return response
        status = response.status_code
        error = ApiError(status, _CODES.get(status, "error"), _message(request, status))
        shaped = JsonResponse(error.body(), status=status, json_dumps_params={"allow_nan": False})
        if response.has_header("Allow"):
            shaped["Allow"] = response["Allow"]
        return shaped



def _reason(exception: Exception) -> str:
    """The message the view raised with, if it gave one as text ("job 99 does not exist")."""
    message = exception.args[0] if exception.args else None
    return message if isinstance(message, str) else ""


def not_found_page(request: HttpRequest, exception: Http404) -> HttpResponse:
    """Django's handler404: the site's page, with what was not found."""
    reason = _reason(exception) or f"there is no page at {request.path}"
    return render(request, "error.html", {"heading": "Not found", "reason": reason}, status=404)


def forbidden_page(request: HttpRequest, exception: PermissionDenied) -> HttpResponse:
    """Django's handler403: the site's page, with why the person may not see it."""
    reason = _reason(exception) or "you may not see this page"
    return render(request, "error.html", {"heading": "Not yours", "reason": reason}, status=403)


class OneLineRefusals(logging.Filter):
    """Django's request logger logs a 403 (PermissionDenied) with its traceback; a refusal is no
    fault of the server: its record keeps one line, with the exception's message appended."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500 and record.exc_info:
            exception = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({exception})" if str(exception) else record.getMessage()
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True
