"""One error shape for the whole API (messages and echoed values bounded by portal.bodies):

    {"error": {"status": 400, "code": "invalid_spec", "message": "...",
               "fields": [{"field": "max_workers", "message": "...", "value": 0}]}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.spec import FieldError
from portal.bodies import MESSAGE_CHARS, cut, shown


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
                "message": cut(self.message, MESSAGE_CHARS),
                "fields": [
                    {"field": f.field, "message": cut(f.message, MESSAGE_CHARS), "value": shown(f.value)}
                    for f in self.fields
                ],
            }
        }



def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} does not exist")


def forbidden(message: str) -> ApiError:
    return ApiError(403, "forbidden", message)


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)
