"""`manage.py create_token USER [--role agent] [--label L]`: print a new API token."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Issue an API token for a user (role user) or for node agents (role agent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", choices=[r.value for r in ApiToken.Role], default="user")
        parser.add_argument("--label", default="")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        _, secret = ApiToken.issue(user, options["label"] or f"{options['role']} token", options["role"])
        self.stdout.write(secret)
