"""ASGI entry: HTTP goes to Django, WebSockets to the live-update consumers."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from portal.body_limit import BodyLimit  # noqa: E402
from portal.body_policy import decide  # noqa: E402
from portal.live.auth import TokenOrSessionAuthMiddleware, origin_checked  # noqa: E402
from portal.live.routing import websocket_urlpatterns  # noqa: E402
from portal.live.unavailable import refused_while_stores_away  # noqa: E402
from portal.scheduling.policy import configured_policy  # noqa: E402
from portal.secrets_check import secret_key_problem  # noqa: E402

configured_policy()  # a bad BUNGEE_POLICY stops the portal here, with the value quoted
_weak_key = secret_key_problem(settings.SECRET_KEY, settings.DEBUG)
if _weak_key is not None:
    raise ImproperlyConfigured(_weak_key)


application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi_app, decide),
        "websocket": refused_while_stores_away(
            origin_checked(TokenOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)))
        ),
    }
)
