"""The JSON API (django-ninja): one NinjaAPI, routers by area, one error shape."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from elastic.spec import FieldError
from portal.errors import ApiError

api = NinjaAPI(
    title="Bungee",
    version="1",
    description="Elastic training on shared GPU clusters. Errors always have the shape "
    '{"error": {"status", "code", "message", "fields": [{"field", "message", "value"}]}}.',
    urls_namespace="api",
)


def _respond(request: HttpRequest, error: ApiError) -> HttpResponse:
    return api.create_response(request, error.body(), status=error.status)


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return _respond(request, exc)


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    fields = []
    for err in exc.errors:
        location = [str(p) for p in err.get("loc", ())]
        if location and location[0] in {"body", "query", "path"}:
            location = location[1:]
        if location and location[0] == "payload":
            location = location[1:]
        fields.append(FieldError(".".join(location) or "body", err.get("msg", "invalid"), err.get("input")))
    message = "; ".join(f"{f.field}: {f.message}" for f in fields) or "invalid request"
    return _respond(request, ApiError(400, "invalid_request", message, fields))


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _respond(request, ApiError(401, "unauthenticated", "log in, or send a valid token as 'Authorization: Bearer <token>'"))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    return _respond(request, ApiError(exc.status_code, "http_error", str(exc)))


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return _respond(request, ApiError(404, "not_found", str(exc) or "not found"))


def _register_routers() -> None:
    from portal.cluster.api import cluster_router
    from portal.jobs.agents import agent_router, board_router
    from portal.jobs.api import router as jobs_router
    from portal.jobs.code_api import agent_code_router
    from portal.jobs.code_api import router as code_router
    from portal.scheduling.api import router as scheduler_router

    api.add_router("/jobs", jobs_router)
    api.add_router("/scheduler", scheduler_router)
    api.add_router("/", board_router)
    api.add_router("/", cluster_router)
    api.add_router("/agent", agent_router)
    api.add_router("/agent", agent_code_router)
    api.add_router("/code", code_router)


_register_routers()
