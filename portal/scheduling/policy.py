"""The scheduling policy the portal runs, from the settings
`settings.BUNGEE.policy` (env BUNGEE_POLICY) and `.resize_cost_s` (env BUNGEE_RESIZE_COST_S).

A name the registry does not know, or a negative resize cost, must stop the portal at start
rather than at the first cycle: `check_policy_setting` is a Django system check (run by every
management command, `migrate` and `check` included), and the Celery worker and the ASGI portal
call `configured_policy` while they start (portal.celery, portal.asgi)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from elastic.scheduling import POLICY_NAMES, Policy, UnknownPolicyError, get_policy


def policy_name() -> str:
    return settings.BUNGEE.policy


def configured_policy() -> Policy:
    """The policy the settings name. Raises ImproperlyConfigured, quoting the bad value."""
    name = policy_name()
    cost = settings.BUNGEE.resize_cost_s
    if not cost >= 0:
        raise ImproperlyConfigured(f"BUNGEE_RESIZE_COST_S={cost!r} must be a number of seconds, at least 0")
    try:
        return get_policy(name, resize_cost_s=cost)
    except UnknownPolicyError:
        raise ImproperlyConfigured(
            f"BUNGEE_POLICY={name!r} is not a scheduling policy; choose one of {', '.join(POLICY_NAMES)}"
        ) from None


def check_policy_setting(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Django system check: the policy setting names a policy and the resize cost is sane."""
    try:
        configured_policy()
    except ImproperlyConfigured as err:
        return [checks.Error(str(err), id="bungee.E001", hint="see docs/reference/configuration.md")]
    return []
