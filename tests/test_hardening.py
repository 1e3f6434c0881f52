"""Hardening: lint and fix survive hostile input and faults, lose nothing and change nothing.

* the engine on pathological input (deep nesting, odd line breaks, syntax errors next to
  suppression comments, rules that misbehave);
* hostile files through the command line: each gives a diagnostic or a one-line error and the
  right exit code (0 clean, 1 findings, 2 usage/config/internal error), never a traceback, and
  the other files are still linted;
* nothing lost: fixes are atomic and keep the mode, broken or unnamed files are never written,
  ``--diff`` writes nothing, concurrent runs share a cache safely;
* security: the linted code is never imported or run, the cache never writes through symlinks.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import libcst as cst
import pytest
from click.testing import CliRunner

from ampdoctor.cli import main
from ampdoctor.lint.engine import Settings, lint_bytes
from ampdoctor.lint.registry import all_infos
from conftest import FIXTURES, ROOT

ALL = Settings(enabled=frozenset(all_infos()))
UNSAFE = Settings(enabled=ALL.enabled, fix="unsafe")

# AMP401 (empty_cache on every batch) and AMP101 (step without update): files with these words
# get past the byte pre-filter and are parsed
WRONG = textwrap.dedent("""\
    import torch

    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        torch.cuda.empty_cache()
""")
RIGHT = textwrap.dedent("""\
    import torch

    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
""")
LOOP = ("import torch\n"
        "for batch in loader:\n"
        "    loss = model(batch)\n"
        "    loss.backward()\n"
        "    torch.cuda.empty_cache()\n")


def codes(result) -> list[tuple[int, str]]:
    return [(d.line, d.code) for d in result.diagnostics]


def messages(result, code: str) -> list[str]:
    return [d.message for d in result.diagnostics if d.code == code]


# -- the engine on pathological input ---------------------------------------------------------

@pytest.mark.parametrize("expr", [
    "(" * 1000 + "1" + ")" * 1000,
    "[" * 1000 + "]" * 1000,
    "a+(" * 1000 + "1" + ")" * 1000,
    "{" * 500 + "}" * 500,
])
def test_bracket_nesting_python_refuses_is_a_syntax_error_at_once(expr):
    src = (LOOP + "x = " + expr + "\n").encode()
    start = time.monotonic()
    r = lint_bytes("deep.py", src, ALL)
    assert time.monotonic() - start < 5  # libcst alone takes minutes on some of these
    assert [(d.line, d.code) for d in r.diagnostics] == [(6, "AMP000")]
    assert messages(r, "AMP000") == ["SyntaxError: too many nested parentheses"]
    assert lint_bytes("deep.py", src, UNSAFE).fixed is None


@pytest.mark.parametrize("expr", [
    "(" * 150 + "1" + ")" * 150,       # nested brackets Python still accepts
    "[" * 199 + "]" * 199,
    "-" * 1000 + "1",                  # deep trees without brackets
    "+".join(["a"] * 1000),
    "a" + ".b" * 1000,
    "f" + "()" * 600,
    " if c else ".join(["a"] * 500),
    "scaler" + ".step(opt)" * 300,
])
def test_deep_nesting_python_accepts_is_linted_and_fixed(expr):
    """libcst and the rules recurse once per level: deep files used to end in AMP001."""
    limit = sys.getrecursionlimit()
    src = (LOOP + "x = " + expr + "\n").encode()
    r = lint_bytes("deep.py", src, ALL)
    assert not messages(r, "AMP001") and not messages(r, "AMP000"), r.diagnostics
    assert (5, "AMP401") in codes(r)
    f = lint_bytes("deep.py", src, UNSAFE)
    assert not messages(f, "AMP001")
    assert f.fixed is not None and b"empty_cache" not in f.fixed
    assert b"\nx = " + expr.encode() + b"\n" in f.fixed
    assert sys.getrecursionlimit() == limit


def test_nesting_only_in_strings_and_comments_is_not_an_error():
    src = (LOOP + "s = '" + "(" * 300 + "'  # " + "[" * 300 + "\n").encode()
    assert codes(lint_bytes("s.py", src, ALL)) == [(5, "AMP401")]


@pytest.mark.parametrize("src, line", [
    ("a = 1\n\n\nb c\n\n\n", 4),
    ("a; if x: y\nb\n", 1),
    ("def f(:\n  pass\n", 1),
    ("x = [1,\n", 1),
])
def test_syntax_errors_are_where_python_puts_them(src, line):
    """libcst's error positions are often a line late; Python's are what users see."""
    body = LOOP + src
    r = lint_bytes("e.py", body.encode(), ALL)
    assert [d.code for d in r.diagnostics] == ["AMP000"]
    assert r.diagnostics[0].line == line + 5
    with pytest.raises(SyntaxError) as exc:
        compile(body, "e.py", "exec")
    assert r.diagnostics[0].line == exc.value.lineno


def test_a_suppression_on_the_next_line_does_not_hide_a_syntax_error():
    src = LOOP + "a = 1; if x: y\nb = 2  # ampdoctor: ignore\n"
    r = lint_bytes("e.py", src.encode(), ALL)
    assert codes(r)[:1] == [(6, "AMP000")]
    # on its own line it is honoured (engine codes can be suppressed like any rule)
    src = LOOP + "a = 1; if x: y  # ampdoctor: ignore[AMP000]\n"
    assert "AMP000" not in [d.code for d in lint_bytes("e.py", src.encode(), ALL).diagnostics]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_fix_edits_count_lines_as_python_does(newline):
    """Form feeds, \\x1c, \\x85 and \\u2028 are not line breaks; lone CR is. The edits in JSON/SARIF
    output used to be lines off after them."""
    body = ("import torch\n# a \x0c form feed\nx = '\u2028'  # \x1c \x85 \x0b\n"
            "for batch in loader:\n    loss.backward()\n    torch.cuda.empty_cache()\n")
    text = body.replace("\n", newline)
    r = lint_bytes("f.py", text.encode(), ALL)
    [d] = r.diagnostics
    assert (d.line, d.code) == (6, "AMP401")
    [edit] = d.fix.edits
    lines = text.splitlines(keepends=True)  # only used to locate the edit by hand below
    assert edit.line in (5, 6) and edit.end_line in (6, 7)
    fixed = lint_bytes("f.py", text.encode(), UNSAFE).fixed.decode()
    from test_fuzz import _apply_edits
    assert _apply_edits(text, d.fix.edits) == fixed
    assert "empty_cache" not in fixed and lines


def test_multi_line_messages_become_one_line(monkeypatch):
    """concise and github output are one diagnostic per line, whatever code a rule quotes."""
    from ampdoctor.lint.rules.amp401_empty_cache_in_loop import EmptyCacheInLoop

    def visit_Call(self, node):
        if "empty_cache" in cst.Module([]).code_for_node(node):
            self.report(node, "line one\n    line two\r\nline three")

    monkeypatch.setattr(EmptyCacheInLoop, "visit_Call", visit_Call)
    r = lint_bytes("m.py", LOOP.encode(), ALL)
    assert messages(r, "AMP401") == ["line one line two line three"]


def test_a_fix_that_never_converges_changes_nothing(monkeypatch):
    """A fix that brings back what it fixes used to be applied ten times over."""
    from ampdoctor.lint import helpers as h
    from ampdoctor.lint.rule import FixSpec
    from ampdoctor.lint.rules.amp401_empty_cache_in_loop import EmptyCacheInLoop

    def _fix(self):
        line, _ = h.statement_of(self.ctx)
        return FixSpec(((line, cst.FlattenSentinel([line, cst.parse_statement("pass\n")])),), safe=False)

    monkeypatch.setattr(EmptyCacheInLoop, "_fix", _fix)
    r = lint_bytes("c.py", LOOP.encode(), UNSAFE)
    assert r.fixed is None and r.fixes_applied == 0
    assert any("did not converge" in m for m in messages(r, "AMP001"))
    assert (5, "AMP401") in codes(r)


def test_a_rule_crash_during_fixing_keeps_the_original_and_reports(monkeypatch):
    from ampdoctor.lint.rules.amp401_empty_cache_in_loop import EmptyCacheInLoop

    def _fix(self):
        raise RuntimeError("fix exploded")

    monkeypatch.setattr(EmptyCacheInLoop, "_fix", _fix)
    r = lint_bytes("c.py", LOOP.encode(), UNSAFE)
    assert r.fixed is None
    assert any("fix exploded" in m for m in messages(r, "AMP001"))
