"""What a terminal of 80, 100 and 120 columns shows: no word broken across lines.

The lint report of every fixture is rendered at each width; every line but the quoted source
fits, and every word of every message, explanation and help appears whole on one line.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from conftest import FIXTURES, ROOT, fixture_selection, lint_text

WIDTHS = (80, 100, 120)


def _fixture_diagnostics():
    diags, sources = [], {}
    for path in sorted((FIXTURES / "lint").rglob("*.py")):
        text = path.read_text("utf-8")
        rel = path.relative_to(ROOT).as_posix()
        sources[rel] = text
        diags.extend(lint_text(text, rel, enabled=fixture_selection(text)).diagnostics)
    return diags, sources


@pytest.fixture(scope="module")
def fixture_report():
    return _fixture_diagnostics()


def _render(diags, sources, width: int) -> list[str]:
    from ampdoctor.report.text import render_diagnostics

    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, force_terminal=False, highlight=False, emoji=False)
    render_diagnostics(console, diags, sources)
    return buf.getvalue().splitlines()


def test_short_messages_fit_the_location_line(fixture_report):
    diags, _ = fixture_report
    long = sorted({d.message for d in diags if len(d.message) > 100})
    assert not long, long


@pytest.mark.parametrize("width", WIDTHS)
def test_lint_text_never_breaks_a_word(fixture_report, width):
    diags, sources = fixture_report
    lines = _render(diags, sources, width)
    prose = [ln for ln in lines if " | " not in ln[:8] and not ln.rstrip().endswith(" |")]
    words_on_lines = [set(ln.split()) for ln in prose]
    for d in diags:
        for text in (d.message, d.explanation or "", d.fix_title or ""):
            for word in text.split():
                assert any(word in ws for ws in words_on_lines), (width, word, d.code)
    for ln in prose:
        assert len(ln) <= width or len(max(ln.split(), key=len)) > width - 4, (width, ln)
    assert any(ln.startswith("  = help: ") for ln in prose)
