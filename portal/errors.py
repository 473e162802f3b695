"""One error shape for the whole API:

    {"error": {"status": 400, "code": "invalid_spec", "message": "...",
               "fields": [{"field": "max_workers", "message": "...", "value": 0}]}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.spec import FieldError


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    fields: list[FieldError] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "status": self.status,
                "code": self.code,
                "message": self.message,
                "fields": [
                    {"field": f.field, "message": f.message, "value": _jsonable(f.value)}
                    for f in self.fields
                ],
            }
        }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} does not exist")


def forbidden(message: str) -> ApiError:
    return ApiError(403, "forbidden", message)


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)
