"""`manage.py device_owner`: a device's owner is set and cleared; a device that does not exist
is refused with the node and index quoted."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import CommandError, call_command

from portal.cluster.models import Device

pytestmark = pytest.mark.django_db


def test_set_and_clear_an_owner(cluster: Any, redis_client: Any) -> None:
    call_command("device_owner", "node-a", "2", "--owner", "carol")
    assert Device.objects.get(node=cluster, index=2).owner == "carol"
    call_command("device_owner", "node-a", "2", "--shared")
    assert Device.objects.get(node=cluster, index=2).owner == ""


@pytest.mark.parametrize("node,index", [("node-z", "0"), ("node-a", "9")])
def test_an_unknown_device_is_refused(cluster: Any, node: str, index: str) -> None:
    with pytest.raises(CommandError, match=f"no device {index} on a node named '{node}'"):
        call_command("device_owner", node, index, "--owner", "carol")
