"""API authentication: a session (browsers; ninja checks CSRF for it) or a bearer token
(scripts use a user token, agents an agent token)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from ninja.security import HttpBearer, django_auth

from portal.accounts.models import ApiToken

LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenAuth(HttpBearer):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = ApiToken.lookup(token)
        if found is None or found.role != self.role:
            return None
        now = timezone.now()
        if found.last_used_at is None or now - found.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=found.pk).update(last_used_at=now)
        request.user = found.user
        request.api_token = found  # type: ignore[attr-defined]
        return found.user


user_auth = [TokenAuth(ApiToken.Role.USER), django_auth]
agent_auth = TokenAuth(ApiToken.Role.AGENT)
