"""ASGI entry: HTTP goes to Django, WebSockets to the live-update consumers."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from elastic.codepack import LEAVE_OUT_ADVICE  # noqa: E402
from portal.body_limit import BodyLimit, Bound  # noqa: E402
from portal.jobs.code_api import UPLOAD_OVERHEAD_BYTES  # noqa: E402
from portal.live.auth import TokenOrSessionAuthMiddleware, origin_checked  # noqa: E402
from portal.live.routing import websocket_urlpatterns  # noqa: E402
from portal.live.unavailable import refused_while_stores_away  # noqa: E402
from portal.scheduling.policy import configured_policy  # noqa: E402
from portal.secrets_check import secret_key_problem  # noqa: E402

configured_policy()  # a bad BUNGEE_POLICY stops the portal here, with the value quoted
_weak_key = secret_key_problem(settings.SECRET_KEY, settings.DEBUG)
if _weak_key is not None:
    raise ImproperlyConfigured(_weak_key)


def body_limit(path: str) -> Bound:
    """The largest request body: a job's artifacts from an agent; a code upload and its form's
    other fields (portal.jobs.code_api), from the API or the submit page; else a JSON or form
    body, BUNGEE_BODY_MAX_BYTES."""
    if path.startswith("/api/agent/jobs/") and path.endswith("/artifacts"):
        return Bound(settings.BUNGEE.artifact_max_bytes, "BUNGEE_ARTIFACT_MAX_BYTES")
    if path in ("/api/code", "/jobs/new/"):
        code = settings.BUNGEE.code_max_bytes
        return Bound(
            code + UPLOAD_OVERHEAD_BYTES,
            f"BUNGEE_CODE_MAX_BYTES={code}, and {UPLOAD_OVERHEAD_BYTES} for the form's other fields",
            LEAVE_OUT_ADVICE,
        )
    return Bound(settings.BUNGEE.body_max_bytes, "BUNGEE_BODY_MAX_BYTES")


application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi_app, body_limit),
        "websocket": refused_while_stores_away(
            origin_checked(TokenOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)))
        ),
    }
)
