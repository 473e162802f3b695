"""`manage.py create_token USER [--role agent|pool|...] [--pool NAME] [--label L] [--replace]`:
print a new API token. An agent token serves one node; a pool token (`--role pool --pool NAME`)
registers new nodes named NAME-..., each getting an agent token of its own. `--replace` deletes
the user's earlier tokens of that label and role first, which frees their node for the new
token (a rotation, or a demo started again); for a pool token it also deletes the tokens of the
nodes it registered."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from portal.accounts.models import ApiToken


class Command(BaseCommand):
    help = (
        "Issue an API token for a user (role user), for a node agent (role agent), for a pool of "
        "node agents started by a machine (role pool, with --pool), or for a Prometheus scraper "
        "(role metrics)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", choices=[r.value for r in ApiToken.Role], default="user")
        parser.add_argument(
            "--pool",
            default="",
            help="role pool only: the pool's name; its token registers only new nodes named NAME-...",
        )
        parser.add_argument("--label", default="")
        parser.add_argument(
            "--replace",
            action="store_true",
            help="delete the user's earlier tokens of this label and role first (for a pool token, "
            "with the tokens of the nodes it registered)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(
                f"no user named {username!r}: name an existing user, or create one first with "
                f"`python manage.py createsuperuser --username {username}` (a staff user, who signs in to "
                "the Scheduler page too)"
            )
        role, pool = options["role"], options["pool"]
        if role == ApiToken.Role.POOL and not pool:
            raise CommandError(
                "a pool token needs its pool's name: --pool NAME (its nodes are named NAME-...)"
            )
        label = options["label"] or (f"pool {pool}" if role == ApiToken.Role.POOL else f"{role} token")
        with transaction.atomic():
            if options["replace"]:
                ApiToken.objects.filter(user=user, label=label, role=role).delete()
            try:
                _, secret = ApiToken.issue(user, label, role, pool=pool)
            except ValueError as err:
                raise CommandError(str(err)) from err
        self.stdout.write(secret)
