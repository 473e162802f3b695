"""The documentation's shape: a short README that a code host shows whole, lines a
reader can read without scrolling sideways, every relative link and anchor landing somewhere,
and every page under docs/ reachable from the index. Pure file reads: no platform."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
REFERENCE = DOCS / "reference"
README_MAX_LINES = 200
MAX_LINE_CHARS = 400

PAGES = sorted([README, *DOCS.rglob("*.md")])
_PARSER = MarkdownIt("commonmark").enable("table")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@cache
def _tokens(page: Path) -> list:  # type: ignore[type-arg]
    return _PARSER.parse(page.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    tokens = _tokens(page)
    found = set()
    for at, token in enumerate(tokens):
        if token.type == "heading_open":
            inline = tokens[at + 1]
            text = "".join(
                child.content for child in inline.children or [] if child.type in ("text", "code_inline")
            )
            found.add(slug(text))
    return frozenset(found)


def links(page: Path) -> list[str]:
    """The targets of the page's links, code blocks and code spans left out."""
    targets = []
    for token in _tokens(page):
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(str(child.attrs.get("href", "")))
    return targets


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


@pytest.mark.parametrize("page", [p for p in PAGES if not p.is_relative_to(REFERENCE)], ids=_name)
def test_no_line_is_too_long(page: Path) -> None:
    """Written pages only: the references under docs/reference/ are generated from the code's
    descriptions, and tests/test_reference_docs.py pins them."""
    long = [
        (number, len(line))
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > MAX_LINE_CHARS
    ]
    assert not long, f"{_name(page)}: lines over {MAX_LINE_CHARS} characters (line, length): {long}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or target.startswith("mailto:"):
            continue
        path = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not REFERENCE.exists() and path.is_relative_to(REFERENCE):
            continue  # the generated references (docs/reference/) arrive with their generator
        if not path.exists():
            broken.append(f"{target} (no {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif parts.fragment and path.suffix == ".md" and parts.fragment not in anchors(path):
            broken.append(f"{target} (no heading #{parts.fragment} in {_name(path)})")
    assert not broken, f"{_name(page)}: broken links: {broken}"


def test_every_page_is_in_the_index() -> None:
    linked = {(INDEX.parent / urlsplit(target).path).resolve() for target in links(INDEX)}
    missing = [_name(page) for page in DOCS.rglob("*.md") if page != INDEX and page.resolve() not in linked]
    assert not missing, f"pages under docs/ that docs/README.md does not link: {missing}"


def test_the_readme_links_into_the_index() -> None:
    assert "docs/README.md" in links(README)


def test_slug_follows_github() -> None:
    assert slug("Consistency: strict, hybrid or plain") == "consistency-strict-hybrid-or-plain"
    assert slug("`.bungeeignore`") == "bungeeignore"
    assert slug("Nodes (staff)") == "nodes-staff"


def _section(page: Path, heading: str) -> str:
    """The text of the `## heading` section of `page`, up to the next `## ` heading."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_quick_start_says_how_to_run_the_demo_elsewhere() -> None:
    """A newcomer whose port 8000 is taken learns from the README itself how to move the demo: each
    variable the demo reads (portal.config.DemoSettings) is named in the quick start, as a
    command to type."""
    from portal.config import DemoSettings

    quick_start = _section(README, "Quick start")
    for field in DemoSettings.model_fields.values():
        variable = field.validation_alias
        assert isinstance(variable, str)
        assert re.search(rf"\b{variable}=\S+ make demo\b", quick_start), f"the quick start does not show {variable}"
