"""Request bodies and error values, with bounds: what a client sends is parsed in bounded time
and memory, and what an error reply echoes of it is short and valid JSON.

- JSON: NaN and Infinity are refused (they are not JSON), and so is nesting deeper than
  MAX_NESTING (the C parser's own recursion limit is caught too).
- YAML: the safe loader (no tags that construct objects), no aliases (an alias bomb expands a
  few hundred bytes into gigabytes), nesting at most MAX_NESTING, checked while composing, so a
  deep document stops early.
- An echoed value is cut to VALUE_CHARS characters of its JSON text; a non-finite number is
  echoed as a string.
The body size is bounded before any of this, by portal.body_limit."""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

import yaml
from yaml.composer import ComposerError

MAX_NESTING = 32
"""Lists and mappings inside each other, at most: a job spec needs three."""
VALUE_CHARS = 200
MESSAGE_CHARS = 500


class BodyError(ValueError):
    """The body is not a document this API takes; the message says why, briefly."""


def parse_json(text: str) -> Any:
    """The JSON document `text`. Raises BodyError."""

    def refuse_constant(name: str) -> Any:
        raise BodyError(f"{name} is not a JSON number; send a finite number")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except RecursionError:
        raise BodyError(f"the JSON is nested deeper than {MAX_NESTING} levels") from None
    except BodyError:
        raise
    except ValueError as err:
        raise BodyError(f"the request body is not valid JSON: {cut(str(err), MESSAGE_CHARS)}") from err
    check_nesting(value)
    return value


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing aliases and nesting deeper than MAX_NESTING."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ComposerError(None, None, "aliases (*name) are not accepted", mark)
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"nested deeper than {MAX_NESTING} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml(text: str) -> Any:
    """The YAML document `text`, with the bounds above. Raises BodyError."""
    loader = _BoundedLoader(text)
    try:
        value = loader.get_single_data()
    except RecursionError:
        raise BodyError(f"the YAML is nested deeper than {MAX_NESTING} levels") from None
    except yaml.YAMLError as err:
        raise BodyError(f"the YAML does not parse: {cut(str(err), MESSAGE_CHARS)}") from err
    finally:
        loader.dispose()
    check_nesting(value)
    _refuse_non_finite(value)
    return value


def check_nesting(value: Any) -> None:
    """Raises BodyError if lists and mappings nest deeper than MAX_NESTING in `value`."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_NESTING:
                raise BodyError(f"the document is nested deeper than {MAX_NESTING} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def _refuse_non_finite(value: Any) -> None:
    """YAML has .nan and .inf; a spec has no use for them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise BodyError(f"{item} is not a finite number; send a finite number")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def shown(value: Any) -> Any:
    """`value` as an error reply echoes it: a scalar as it is (a non-finite float or a long
    string as a cut string), anything else as its JSON text cut to VALUE_CHARS."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return cut(value, VALUE_CHARS)
    try:
        text = json.dumps(value, default=repr, allow_nan=True)
    except (ValueError, RecursionError):
        text = reprlib.repr(value)  # bounded in depth and length
    return cut(text, VALUE_CHARS)
