"""``bench/RESULTS.md`` and the README's headline table are what ``python -m bench.report``
renders from the committed JSON in ``bench/results/``: a stale page fails here."""

from __future__ import annotations

from bench.report import BEGIN, END, PAGE, README, readme_headlines, render


def _undated(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("Rendered by")]


def test_the_results_page_is_rendered_from_the_committed_json() -> None:
    assert _undated(PAGE.read_text()) == _undated(render()), "run python -m bench.report"


def test_the_readme_table_is_rendered_from_the_committed_json() -> None:
    text = README.read_text()
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip().splitlines()
    assert block == readme_headlines(), "run python -m bench.report"
