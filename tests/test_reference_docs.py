"""The reference pages under docs/reference/ are what docs/generate.py makes of today's code: the
job spec, the configuration and /metrics. A change to any of them without `make docs` fails here,
naming the stale page."""

from __future__ import annotations

import pytest

from docs import generate


@pytest.mark.django_db
def test_the_reference_pages_are_generated_from_todays_code() -> None:
    stale = generate.stale_pages()
    assert not stale, f"stale, not what the code gives now: {', '.join(stale)}; run `{generate.COMMAND}` and commit them"


def test_every_spec_field_is_on_the_page_with_its_meaning() -> None:
    from elastic.spec import JobSpec

    page = generate.spec_page()
    for name, field in JobSpec.model_fields.items():
        assert field.description, f"JobSpec.{name} has no description for docs/reference/spec.md"
        assert f"| `{name}` |" in page
