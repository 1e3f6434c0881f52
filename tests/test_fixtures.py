"""Every file under fixtures/lint carries its expected findings inline (``# expect: CODE``).

Lines without a marker must get no diagnostic: each clean look-alike is a test too.
"""

from __future__ import annotations

import pytest

from conftest import FIXTURES, expected_markers, fixture_selection, lint_text

LINT_FIXTURES = sorted((FIXTURES / "lint").rglob("*.py"))


@pytest.mark.parametrize("path", LINT_FIXTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_findings_match_markers(path):
    text = path.read_text("utf-8")
    result = lint_text(text, path.name, enabled=fixture_selection(text))
    got = {(d.line, d.code) for d in result.diagnostics}
    want = expected_markers(text)
    missing = sorted(want - got)
    unexpected = sorted((line, code, next(d.message for d in result.diagnostics if (d.line, d.code) == (line, code)))
                        for line, code in got - want)
    assert not missing and not unexpected, f"missing: {missing}\nunexpected: {unexpected}"


def test_there_are_fixtures_for_every_rule():
    from ampdoctor.lint.registry import rule_classes

    marked = set()
    for p in LINT_FIXTURES:
        marked |= {code for _, code in expected_markers(p.read_text("utf-8"))}
    missing = [r.code for r in rule_classes() if r.code not in marked]
    assert not missing, f"rules without a fixture line that triggers them: {missing}"
