"""Error replies. Every error reply under /api/ has the API's error shape (portal.errors), also
those Django makes before or outside the API's views: no URL matched (404), a method the URL does
not take (405), a body Django refused to read (400), a server error (500). The status and its
headers (Allow) are kept; the HTML or plain text becomes the JSON shape. Redis not answering is a
503 with Retry-After.

A person's 403 and 404 are the site's page (header and navigation) saying why; and a refusal is
logged as one line, not as a traceback (`OneLineRefusals`)."""

from __future__ import annotations

import logging

import redis
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.deprecation import MiddlewareMixin

from portal.errors import ApiError

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


class ApiErrorShape(MiddlewareMixin):
    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Redis away (after the client's bounded retries): 503 in the error shape, at once."""
        if request.path.startswith("/api/") and isinstance(exception, redis.ConnectionError | redis.TimeoutError):
            error = ApiError(503, "unavailable", f"the portal's Redis is not answering ({exception}); try again shortly")
            response = JsonResponse(error.body(), status=503)
            response["Retry-After"] = "5"
            return response
        return None

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
