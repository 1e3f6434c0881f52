"""Fix pairs under fixtures/fix: NAME.py becomes NAME.fixed.py with ``--fix --unsafe-fixes``.

A ``# fixture-fix: safe`` header limits a pair to safe fixes, ``# fixture-min-torch: 2.3``
sets the project's minimum torch version.
"""

from __future__ import annotations

import re

import libcst
import pytest

from conftest import FIXTURES, fixture_selection, lint_text

PAIRS = sorted(p for p in (FIXTURES / "fix").glob("*.py") if not p.name.endswith(".fixed.py"))


def _options(text: str):
    mode = re.search(r"^#\s*fixture-fix:\s*(safe|unsafe)\s*$", text, re.M)
    mt = re.search(r"^#\s*fixture-min-torch:\s*([0-9.]+)\s*$", text, re.M)
    min_torch = tuple(int(x) for x in mt.group(1).split(".")) if mt else None
    return (mode.group(1) if mode else "unsafe"), min_torch


@pytest.mark.parametrize("src", PAIRS, ids=lambda p: p.stem)
def test_fix_pair(src):
    text = src.read_text("utf-8")
    expected_path = src.with_name(src.stem + ".fixed.py")
    assert expected_path.exists(), f"{expected_path.name} is missing"
    mode, min_torch = _options(text)
    enabled = fixture_selection(text)
    before = lint_text(text, src.name, enabled=enabled, min_torch=min_torch)
    fixed = lint_text(text, src.name, enabled=enabled, fix=mode, min_torch=min_torch)
    assert fixed.fixed is not None, "no fix was applied"
    new = fixed.fixed.decode("utf-8")
    assert new == expected_path.read_text("utf-8")
    libcst.parse_module(new)  # the result parses
    def applicable(result):
        return [(d.line, d.code) for d in result.diagnostics
                if d.fix and (mode == "unsafe" or d.fix.applicability.value == "safe")]

    assert applicable(before), "the input has nothing to fix"
    # every diagnostic that had an applicable fix is gone
    after = lint_text(new, src.name, enabled=enabled, min_torch=min_torch)
    assert applicable(after) == []
    assert len(after.diagnostics) < len(before.diagnostics)
    # a second fix is a no-op
    again = lint_text(new, src.name, enabled=enabled, fix=mode, min_torch=min_torch)
    assert again.fixed is None
