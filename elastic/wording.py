"""Counts in the sentences people read ("1 worker", "2 workers"), shared by the scheduler's
reasons, the portal's messages and the API's refusals; the pages' scripts have the same rule
(static/js/format.js)."""

from __future__ import annotations


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """Returns `number` with `noun`, made plural unless the number is exactly 1: "1 worker",
    "0 workers", "3 devices". `plural` is for a noun that does not just take an "s"."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
