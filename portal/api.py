"""The JSON API (django-ninja): one NinjaAPI, routers by area, one error shape."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from pydantic import BaseModel, Field

from elastic.spec import FieldError
from portal.bodies import BodyError, cut, parse_json
from portal.errors import ApiError


class FieldErrorOut(BaseModel):
    field: str
    message: str
    value: Any = Field(None, description="what was sent there, cut to 200 characters of JSON")


class ErrorDetail(BaseModel):
    status: int
    code: str = Field(description="malformed_body, invalid_spec, not_found, forbidden, too_large, ...")
    message: str
    fields: list[FieldErrorOut]


class ErrorOut(BaseModel):
    error: ErrorDetail


class ObjectJsonParser(Parser):
    """The JSON body of every ninja endpoint is an object: ninja would take `null` as "no body",
    and so as the defaults, and hand a list to a model that expects fields. NaN is still parsed
    here, so that an agent's report refuses a sample holding one item by item; a field that must
    be finite says so itself (allow_inf_nan=False)."""

    def parse_body(self, request: HttpRequest) -> dict[str, Any]:
        value = super().parse_body(request)
        if not isinstance(value, dict):
            text = request.body.decode("utf-8", errors="replace")
            raise BodyError(f"the body must be a JSON object, not {cut(text, 40)}")
        return value


class BungeeApi(NinjaAPI):
    """The API, whose OpenAPI document also describes every operation's refusals: a 4xx in the
    one error shape (`Error`)."""

    def get_openapi_schema(self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None) -> Any:
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        error = ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(error.pop("$defs", {}))
        components["Error"] = error
        refused = {
            "description": "refused: the error shape, naming each bad field and what was sent",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                if isinstance(operation, dict) and "responses" in operation:
                    operation["responses"].setdefault("4XX", refused)
        return schema


api = BungeeApi(
    title="Bungee",
    version="1",
    description="Elastic training on shared GPU clusters. Errors always have the shape "
    '{"error": {"status", "code", "message", "fields": [{"field", "message", "value"}]}}.',
    urls_namespace="api",
    parser=ObjectJsonParser(),
)


def _respond(request: HttpRequest, error: ApiError) -> HttpResponse:
    return api.create_response(request, error.body(), status=error.status)


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return _respond(request, exc)


def _sent_value(request: HttpRequest, location: list[str]) -> Any:
    """What the JSON body holds at `location` (ninja's errors leave the value out), or None."""
    try:
        value: Any = parse_json(request.body.decode("utf-8", errors="replace"))
    except BodyError:
        return None
    for part in location:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    fields = []
    for err in exc.errors:
        location = [str(p) for p in err.get("loc", ())]
        source = location[0] if location else ""
        if source in {"body", "query", "path"}:
            location = location[1:]
        if location and location[0] == "payload":
            location = location[1:]
        value = err.get("input")
        if value is None and source == "body":
            value = _sent_value(request, location)
        elif value is None and source == "query" and location:
            value = request.GET.get(location[0])
        fields.append(FieldError(".".join(location) or "body", err.get("msg", "invalid"), value))
    message = "; ".join(f"{f.field}: {f.message}" for f in fields) or "invalid request"
    return _respond(request, ApiError(400, "invalid_request", message, fields))


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _respond(request, ApiError(401, "unauthenticated", "log in, or send a valid token as 'Authorization: Bearer <token>'"))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    # ninja's 400 is a body it could not parse: the same code as submit's own parse errors.
    code = "malformed_body" if exc.status_code == 400 else "http_error"
    # ninja says only "Cannot parse request body"; what ObjectJsonParser refused says why.
    message = str(exc.__cause__) if isinstance(exc.__cause__, BodyError) else str(exc)
    return _respond(request, ApiError(exc.status_code, code, message))


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
