"""The text the character-level task trains on: the source of a few fixed, pure-Python
standard-library modules, read from disk (never imported), so it needs no download and every
worker of one installation reads the same characters. No torch here: Bungee's portal counts the
samples of an epoch with it."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

CORPUS_MODULES = ("textwrap", "string", "queue", "glob", "fnmatch", "colorsys", "bisect")
"""Standard-library modules whose source, joined in this order, is the corpus."""


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """Return the corpus. Raises RuntimeError if a module's source file cannot be found."""
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise RuntimeError(f"no Python source for standard-library module {name!r}")
        with open(spec.origin, encoding="utf-8") as source:
            parts.append(source.read())
    return "\n".join(parts)


def vocabulary() -> str:
    """Return the distinct characters of the corpus, sorted: a token is an index into it."""
    return "".join(sorted(set(corpus_text())))


def window_count(block_size: int) -> int:
    """Return how many training windows the corpus holds: consecutive, non-overlapping runs of
    `block_size` input characters, each followed by the character its last position predicts."""
    return (len(corpus_text()) - 1) // block_size
