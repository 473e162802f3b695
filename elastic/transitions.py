"""What every state machine of Bungee shares: the refusal of a move its table does not list.

Each lifecycle (a job, a node, a generation, a standby, a worker process) keeps its enum, its
docstring listing every transition and its table in the module that owns it; this module holds
the one check they all make and the error it raises, so that a refusal reads the same
whichever machine refused. Django-free, as everything under `elastic/`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

State = TypeVar("State", bound=Enum)


class InvalidMove(Exception):  # noqa: N818 - named for what it is, like Django's PermissionDenied
    """A move the state machine does not list. Subclasses name what moved (`what`)."""

    what = "it"

    def __init__(self, source: str, target: str) -> None:
        super().__init__(f"{self.what} cannot go from {str(source)!r} to {str(target)!r}")
        self.source = source
        self.target = target


def check_move(
    table: Mapping[State, frozenset[State]], state: type[State], source: str, target: str, error: type[InvalidMove]
) -> None:
    """Raises `error(source, target)` unless `table` lets `source` go to `target` (both read as
    values of `state`; a value that is not one raises ValueError, as the enum does)."""
    if state(target) not in table[state(source)]:
        raise error(source, target)
