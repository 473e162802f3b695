"""bench/plots.py draws the plots of bench/RESULTS.md from the committed benchmark runs."""

from __future__ import annotations

from pathlib import Path

from bench import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_plots_are_drawn_from_the_committed_runs(tmp_path: Path) -> None:
    written = plots.draw(plots.RESULTS, tmp_path)
    assert sorted(path.name for path in written) == sorted(plots.FIGURES)
    for path in written:
        assert path.read_bytes().startswith(PNG_SIGNATURE), f"{path.name} is no PNG"
