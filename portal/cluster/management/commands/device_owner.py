"""`manage.py device_owner NODE INDEX --owner NAME` (or `--shared`): say whom a device belongs
to. An owned device is only lent, to opportunistic jobs, while its owner is away; a shared one
serves everyone, guaranteed jobs first."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.cluster.models import Device
from portal.trigger import request_schedule


class Command(BaseCommand):
    help = "Set the owner of a device (or give it back to the shared pool)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node")
        parser.add_argument("index", type=int)
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument("--owner", help="who the device belongs to")
        who.add_argument("--shared", action="store_true", help="the device belongs to the shared pool")

    def handle(self, *args: Any, **options: Any) -> None:
        device = Device.objects.filter(node__name=options["node"], index=options["index"]).first()
        if device is None:
            raise CommandError(f"no device {options['index']!r} on a node named {options['node']!r}")
        owner = "" if options["shared"] else options["owner"].strip()
        if not options["shared"] and not owner:
            raise CommandError("--owner needs a name")
        Device.objects.filter(pk=device.pk).update(owner=owner)
        request_schedule(f"device {device} now belongs to {owner or 'the shared pool'}")
        self.stdout.write(f"{device}: {'owned by ' + owner if owner else 'shared'}")
