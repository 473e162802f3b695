"""API tokens: how scripts and agents authenticate. Only a digest is stored; the token itself
is shown once, when it is made."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiToken(models.Model):
    class Role(models.TextChoices):
        USER = "user", "user (scripts, CLI)"
        AGENT = "agent", "agent (node agents)"
        METRICS = "metrics", "metrics (a Prometheus scraper: /metrics only)"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tokens")
    label = models.CharField(max_length=100)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.USER)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=8, editable=False, help_text="first characters, to recognise it")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.label} ({self.role}, {self.prefix}…)"

    @classmethod
    def issue(cls, user: models.Model, label: str, role: str = Role.USER) -> tuple[ApiToken, str]:
        """Create a token; returns the row and the secret, which is not stored anywhere."""
        secret = "bng_" + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user, label=label, role=role, digest=token_digest(secret), prefix=secret[:8]
        )
        return token, secret

    @classmethod
    def lookup(cls, secret: str) -> ApiToken | None:
        """The token with this secret, its user loaded, or None if there is none or the user is
        inactive."""
        token = cls.objects.select_related("user").filter(digest=token_digest(secret)).first()
        if token is None or not token.user.is_active:
            return None
        return token
