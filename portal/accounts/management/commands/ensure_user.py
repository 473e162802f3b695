"""`manage.py ensure_user NAME --password P [--staff]`: create the user, or reset its password."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Create a user (or reset its password), for demos and tests."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--password", required=True)
        parser.add_argument("--staff", action="store_true", help="staff and superuser")

    def handle(self, *args: Any, **options: Any) -> None:
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        user.set_password(options["password"])
        user.is_staff = user.is_superuser = options["staff"]
        user.save()
        self.stdout.write(f"{'created' if created else 'updated'} user {user.get_username()}")
