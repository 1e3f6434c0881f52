from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9,\s]+?)\s*(?:#|$)")
_SELECT = re.compile(r"^#\s*fixture-select:\s*(.+)$", re.M)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run the long fuzzing tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def expected_markers(text: str) -> set[tuple[int, str]]:
    """``# expect: AMP101, AMP401`` on a line -> {(line, "AMP101"), (line, "AMP401")}."""
    out = set()
    for i, line in enumerate(text.splitlines(), start=1):
        m = _EXPECT.search(line)
        if m:
            for code in re.split(r"[\s,]+", m.group(1).strip()):
                if code:
                    out.add((i, code))
    return out


def fixture_selection(text: str) -> frozenset[str]:
    """All codes, or those named by a ``# fixture-select: AMP1, AMP401`` header."""
    from ampdoctor.lint.registry import all_infos, expand

    m = _SELECT.search(text)
    if not m:
        return frozenset(all_infos())
    return frozenset().union(*(expand(c) for c in re.split(r"[\s,]+", m.group(1).strip()) if c))


def trace_fixture(name: str):
    """Import ``fixtures/trace/<name>.py`` as a module (its ``train`` function, its models)."""
    import importlib
    import sys

    folder = str(FIXTURES / "trace")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def lint_text(text: str, path: str = "snippet.py", enabled=None, fix=None, min_torch=None):
    from ampdoctor.lint.engine import Settings, lint_bytes
    from ampdoctor.lint.registry import all_infos

    settings = Settings(enabled=frozenset(enabled if enabled is not None else all_infos()),
                        min_torch=min_torch, fix=fix)
    return lint_bytes(path, text.encode("utf-8"), settings)


@pytest.fixture(autouse=True)
def _no_colour(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("AMPDOCTOR_NO_CACHE", "1") if os.environ.get("AMPDOCTOR_TEST_NO_CACHE") else None
