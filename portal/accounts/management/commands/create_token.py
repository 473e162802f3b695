"""`manage.py create_token USER [--role agent] [--label L] [--replace]`: print a new API token.
An agent token serves one node; `--replace` deletes the user's earlier tokens of that label and
role first, which frees their node for the new token (a rotation, or a demo started again)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from portal.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Issue an API token for a user (role user) or for node agents (role agent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", choices=[r.value for r in ApiToken.Role], default="user")
        parser.add_argument("--label", default="")
        parser.add_argument(
            "--replace",
            action="store_true",
            help="delete the user's earlier tokens of this label and role first",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        label = options["label"] or f"{options['role']} token"
        with transaction.atomic():
            if options["replace"]:
                ApiToken.objects.filter(user=user, label=label, role=options["role"]).delete()
            _, secret = ApiToken.issue(user, label, options["role"])
        self.stdout.write(secret)
