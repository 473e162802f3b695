"""API tokens: how scripts and agents authenticate. Only a digest is stored; the token itself
is shown once, when it is made.

A pool token (role `pool`) stands for a pool of nodes started by a machine, not a person (a
Slurm pool's agent jobs, a Kubernetes DaemonSet): it only registers new nodes named
`<pool>-...`, and each such registration issues the node an agent token of its own, which the
node then uses for everything else (portal.cluster.binding). Those node tokens point back at
the pool token through `issued_by`: deleting the pool token deletes them."""

from __future__ import annotations

import hashlib
import re
import secrets

from django.conf import settings
from django.db import models

from elastic.wire import POOL_NAME_PATTERN

LABEL_CHARS = 100


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiToken(models.Model):
    class Role(models.TextChoices):
        USER = "user", "user (scripts, CLI)"
        AGENT = "agent", "agent (node agents)"
        METRICS = "metrics", "metrics (a Prometheus scraper: /metrics only)"
        POOL = "pool", "pool (registers new nodes of its pool, each getting an agent token)"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tokens")
    label = models.CharField(max_length=LABEL_CHARS)
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.USER)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=8, editable=False, help_text="first characters, to recognise it")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    pool = models.CharField(
        max_length=40,
        blank=True,
        default="",
        editable=False,
        help_text="role pool only: the pool's name; it registers only nodes named '<pool>-...'",
    )
    issued_by = models.ForeignKey(
        "self",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        editable=False,
        related_name="issued_tokens",
        help_text="the pool token whose registration of a node issued this agent token; deleting "
        "the pool token deletes it",
    )

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(role="pool") & ~models.Q(pool=""))
                | (~models.Q(role="pool") & models.Q(pool="")),
                name="api_token_pool_name_iff_pool_role",
            ),
            models.CheckConstraint(
                condition=models.Q(issued_by__isnull=True) | models.Q(role="agent"),
                name="api_token_only_agent_tokens_are_issued_by_a_pool",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.label} ({self.role}, {self.prefix}…)"

    @property
    def node_prefix(self) -> str:
        """What the name of every node a pool token registers starts with: `<pool>-`."""
        return f"{self.pool}-"

    @classmethod
    def issue(
        cls,
        user: models.Model,
        label: str,
        role: str = Role.USER,
        pool: str = "",
        issued_by: ApiToken | None = None,
    ) -> tuple[ApiToken, str]:
        """Create a token; returns the row and the secret, which is not stored anywhere. Raises
        ValueError if `pool` is given for a role other than pool, missing for a pool token, or
        not a pool name (POOL_NAME_PATTERN)."""
        if (role == cls.Role.POOL) != bool(pool):
            raise ValueError(
                f"a pool name goes with role 'pool' and only with it (role {role!r}, pool {pool!r})"
            )
        if pool and not re.fullmatch(POOL_NAME_PATTERN, pool):
            raise ValueError(
                f"{pool!r} is not a pool name: 1 to 40 letters, digits, '_' or '.', starting with a "
                "letter or digit (no '-': it ends the pool's node-name prefix)"
            )
        secret = "bng_" + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user,
            label=label,
            role=role,
            digest=token_digest(secret),
            prefix=secret[:8],
            pool=pool,
            issued_by=issued_by,
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
