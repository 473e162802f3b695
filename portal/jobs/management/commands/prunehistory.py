"""`manage.py prunehistory [--dry-run]`: what the beat does every hour (portal.jobs.history),
now: thin old metrics and device samples, cut the logs of jobs that ended long ago. With
--dry-run it changes nothing and says what it would delete."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from portal.jobs import history


class Command(BaseCommand):
    help = "Thin old metrics and device samples and cut old logs, as the retention settings say."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="change nothing; say what would be deleted")

    def handle(self, *args: Any, **options: Any) -> None:
        pruned = history.prune(dry_run=options["dry_run"])
        for line in pruned.lines(options["dry_run"]):
            self.stdout.write(line)
