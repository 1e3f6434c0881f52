"""What users see, pinned: per rule, the concise output of every fixture finding.

``tests/snapshots/AMPxxx.txt`` holds ``path:line:col: CODE message`` for each finding of that
rule on ``fixtures/lint``. A changed message or position shows up in review as a diff of these
files. Regenerate with ``AMPDOCTOR_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshots.py``.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

from conftest import FIXTURES, ROOT, fixture_selection, lint_text

SNAPSHOTS = ROOT / "tests" / "snapshots"
UPDATE = bool(os.environ.get("AMPDOCTOR_UPDATE_SNAPSHOTS"))


def _current() -> dict[str, str]:
    lines: dict[str, list[str]] = defaultdict(list)
    for path in sorted((FIXTURES / "lint").rglob("*.py")):
        text = path.read_text("utf-8")
        rel = path.relative_to(ROOT).as_posix()
        result = lint_text(text, rel, enabled=fixture_selection(text))
        for d in sorted(result.diagnostics, key=lambda d: (d.line, d.column, d.code)):
            lines[d.code].append(f"{rel}:{d.line}:{d.column}: {d.code} {d.message}")
    return {code: "\n".join(v) + "\n" for code, v in sorted(lines.items())}


@pytest.fixture(scope="module")
def current() -> dict[str, str]:
    return _current()


def test_snapshots_match(current):
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        for old in SNAPSHOTS.glob("*.txt"):
            if old.stem not in current:
                old.unlink()
        for code, text in current.items():
            (SNAPSHOTS / f"{code}.txt").write_text(text, "utf-8")
    stale = sorted(p.stem for p in SNAPSHOTS.glob("*.txt") if p.stem not in current)
    assert not stale, f"snapshots of rules with no fixture finding: {stale}"
    changed = []
    for code, text in current.items():
        path = SNAPSHOTS / f"{code}.txt"
        if not path.exists() or path.read_text("utf-8") != text:
            changed.append(code)
    assert not changed, (f"output changed for {changed}; review and run "
                         "AMPDOCTOR_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshots.py")
