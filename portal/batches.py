"""Deleting many rows without one long statement: a few thousand at a time, so that pruning a
large table holds no lock for long and never loads the table."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

DELETE_BATCH = 5000


def delete_in_batches(rows: QuerySet[Any], dry_run: bool = False) -> int:
    """Deletes `rows` DELETE_BATCH at a time, in order of id; returns how many (in a dry run,
    deletes nothing and returns how many there are)."""
    if dry_run:
        return rows.count()
    deleted = 0
    while ids := list(rows.order_by("id").values_list("id", flat=True)[:DELETE_BATCH]):
        deleted += rows.model.objects.filter(id__in=ids).delete()[0]
    return deleted
