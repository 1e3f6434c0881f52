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


def test_many_identical_lines_do_not_make_fix_edits_quadratic():
    """The edits of each offered fix were diffed over the whole file with a matcher that is
    quadratic in repeated lines: a 460 kB file of comment lines took 17 s, 5 MB would take 40 min."""
    src = (LOOP + "# the same comment line\n" * 16000).encode()
    start = time.monotonic()
    r = lint_bytes("c.py", src, ALL)
    assert codes(r) == [(5, "AMP401")] and r.diagnostics[0].fix is not None
    assert time.monotonic() - start < 8


# -- hostile files through the command line -----------------------------------------------

def lint(args, expect_exit=None, input=None):
    """``ampdoctor lint`` in-process; never a traceback, never an exception other than the exit."""
    r = CliRunner().invoke(main, ["lint", "--no-cache", "--format", "concise", "-j", "1", *args],
                           input=input, catch_exceptions=True)
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    if expect_exit is not None:
        assert r.exit_code == expect_exit, r.output
    return r


def found(r) -> list[str]:
    """``path:line CODE`` of every concise diagnostic line."""
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(": ", 1)
        if len(parts) == 2 and parts[1][:3] == "AMP":
            path, ln = parts[0].split(":")[:2]
            out.append(f"{path}:{ln} {parts[1].split(' ')[0]}")
    return sorted(out)


GOOD = ["good.py:7 AMP101", "good.py:8 AMP401"]


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A folder with one ordinary file that has two findings, next to which hostile files go."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.py").write_text(WRONG)
    return tmp_path


def one_line_errors(r) -> list[str]:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith("ampdoctor: error: ") for ln in lines), r.stderr
    return lines


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 40 + b"scaler.step(opt)\n",
    b"\x7fELF\x02\x01\x01" + b"\x00" * 64 + b"scaler.step(opt)" + bytes(range(128, 256)),
    b"\x89PNG\r\n\x1a\n" + b"\xff\xd8" * 100 + b"torch.cuda.empty_cache()",
])
def test_binary_content_named_py(proj, content):
    Path("blob.py").write_bytes(content)
    r = lint(["."], expect_exit=1)
    blob = [f for f in found(r) if f.startswith("blob.py")]
    assert blob in (["blob.py:1 AMP002"], ["blob.py:1 AMP000"]), r.stdout
    assert [f for f in found(r) if f.startswith("good.py")] == GOOD
    assert "cannot decode" in r.stdout or "null bytes" in r.stdout


@pytest.mark.parametrize("head, message", [
    ("", "can't decode byte 0xe9"),
    ("# -*- coding: utf-8 -*-\n", "can't decode byte 0xe9"),
    ("# vim: set fileencoding=klingon :\n", "unknown encoding"),
    ("\ufeff# coding: latin-1\n", "encoding problem"),
])
def test_undecodable_files_are_unreadable_file_diagnostics(proj, head, message):
    data = head.encode("utf-8") + WRONG.encode() + b"# caf\xe9\n"
    Path("bad.py").write_bytes(data)
    r = lint(["."], expect_exit=1)
    assert found(r) == ["bad.py:1 AMP002", *GOOD]
    assert message in r.stdout
    r = lint(["--fix", "--unsafe-fixes", "."], expect_exit=1)
    assert Path("bad.py").read_bytes() == data  # never rewritten


def test_latin1_with_a_cookie_is_linted_and_fixed_in_latin1(proj):
    data = ("# -*- coding: latin-1 -*-\n# caf\xe9 cr\xe8me\n" + WRONG).encode("latin-1")
    Path("latin.py").write_bytes(data)
    r = lint(["latin.py"], expect_exit=1)
    assert found(r) == ["latin.py:10 AMP401", "latin.py:9 AMP101"]
    lint(["--fix", "--unsafe-fixes", "latin.py"], expect_exit=0)
    fixed = Path("latin.py").read_bytes()
    assert fixed == ("# -*- coding: latin-1 -*-\n# caf\xe9 cr\xe8me\n" + RIGHT).encode("latin-1")


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_bom_and_line_endings_are_kept_when_fixing(proj, newline, bom):
    data = bom + WRONG.replace("\n", newline).encode()
    Path("nl.py").write_bytes(data)
    r = lint(["nl.py"], expect_exit=1)
    assert found(r) == ["nl.py:7 AMP101", "nl.py:8 AMP401"]
    lint(["--fix", "--unsafe-fixes", "nl.py"], expect_exit=0)
    fixed = Path("nl.py").read_bytes()
    assert fixed.startswith(bom + b"import torch" + newline.encode())
    body = fixed[len(bom):].decode()
    assert body.replace(newline, "\n").rstrip("\n") == RIGHT.rstrip("\n")
    others = {"\n", "\r\n", "\r"} - {newline}
    assert not any(o in body.replace(newline, "") for o in others)


def test_lone_cr_fix_keeps_the_last_line_break(proj):
    data = WRONG.replace("\n", "\r").encode()
    Path("cr.py").write_bytes(data)
    lint(["--fix", "--unsafe-fixes", "cr.py"], expect_exit=0)
    assert Path("cr.py").read_bytes() == RIGHT.replace("\n", "\r").encode()


def test_form_feeds_and_tabs(proj):
    src = ("import torch\n\x0c\n# section two \x0c\n"
           "def train(loader, model, optimizer, scaler):\n"
           "\tfor batch in loader:\n"
           "\t\tloss = model(batch)\n"
           "\t\tscaler.scale(loss).backward()  \x0c\n"
           "\t\tscaler.step(optimizer)\n"
           "\t\ttorch.cuda.empty_cache()\n")
    Path("ff.py").write_text(src)
    r = lint(["ff.py"], expect_exit=1)
    assert found(r) == ["ff.py:8 AMP101", "ff.py:9 AMP401"]
    r = lint(["--format", "json", "ff.py"], expect_exit=1)
    doc = json.loads(r.stdout)
    edits = {d["code"]: d["fix"]["edits"] for d in doc["diagnostics"]}
    assert edits["AMP401"][0]["location"]["line"] in (8, 9)
    lint(["--fix", "--unsafe-fixes", "ff.py"], expect_exit=0)
    assert Path("ff.py").read_text() == src.replace("\t\ttorch.cuda.empty_cache()\n", "\t\tscaler.update()\n")


def test_text_format_shows_the_right_source_line_after_a_form_feed(proj):
    Path("ff.py").write_text("import torch\n\x0c\nfor batch in loader:\n    loss.backward()\n"
                             "    torch.cuda.empty_cache()\n")
    r = CliRunner().invoke(main, ["lint", "--no-cache", "ff.py"])
    assert "5 |     torch.cuda.empty_cache()" in r.stdout, r.stdout


def test_nul_bytes(proj):
    Path("nul.py").write_bytes(WRONG.encode() + b"x = '\x00'\n")
    r = lint(["."], expect_exit=1)
    assert found(r) == GOOD + ["nul.py:9 AMP000"]
    assert "null bytes" in r.stdout
    lint(["--fix", "--unsafe-fixes", "nul.py"], expect_exit=1)
    assert Path("nul.py").read_bytes().endswith(b"x = '\x00'\n")


def test_a_5_mb_file(proj):
    doc = "lorem ipsum dolor sit amet, consectetur adipiscing elit\n" * 80_000
    comments = "# padding padding padding padding padding padding\n" * 20_000
    src = f'"""{doc}"""\n{comments}{WRONG}'
    assert len(src) > 5_000_000
    Path("big.py").write_text(src)
    line = src.count("\n", 0, src.index("torch.cuda.empty_cache()")) + 1
    start = time.monotonic()
    r = lint(["big.py"], expect_exit=1)
    assert found(r) == [f"big.py:{line - 1} AMP101", f"big.py:{line} AMP401"]
    lint(["--fix", "--unsafe-fixes", "big.py"], expect_exit=0)
    assert Path("big.py").read_text().endswith(RIGHT)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("expr", [
    "(" * 1000 + "1" + ")" * 1000,
    "[" * 1000 + "]" * 1000,
    "a+(" * 1000 + "a" + ")" * 1000,
])
def test_1000_deep_nested_expressions(proj, expr):
    Path("deep.py").write_text(WRONG + "x = " + expr + "\n")
    r = lint(["."], expect_exit=1)
    assert found(r) == ["deep.py:9 AMP000", *GOOD]
    assert "too many nested parentheses" in r.stdout


def test_deep_expression_python_accepts(proj):
    Path("deep.py").write_text(WRONG + "x = " + "+".join(["a"] * 1000) + "\n")
    r = lint(["."], expect_exit=1)
    assert found(r) == ["deep.py:7 AMP101", "deep.py:8 AMP401", *GOOD]


@pytest.mark.parametrize("content", [b"", b"\n", b"\xef\xbb\xbf", b"   ", b"# scaler\n", b"\r\n\r\n"])
def test_empty_files(proj, content):
    Path("empty.py").write_bytes(content)
    r = lint(["empty.py"], expect_exit=0)
    assert "All checks passed (1 file checked)." in r.stdout
    assert found(lint(["."], expect_exit=1)) == GOOD


def test_unreadable_file(proj, monkeypatch):
    Path("secret.py").write_text(WRONG)
    Path("secret.py").chmod(0)
    Path("locked").mkdir()
    Path("locked").chmod(0)
    if os.geteuid() == 0:
        # root reads a chmod 000 file: the operating system's answer to anyone else, simulated
        real_open, real_scandir = os.open, os.scandir

        def fake_open(path, *args, **kwargs):
            if os.path.basename(os.fspath(path)) == "secret.py":
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real_open(path, *args, **kwargs)

        def fake_scandir(path="."):
            if os.path.basename(os.fspath(path)) == "locked":
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real_scandir(path)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "scandir", fake_scandir)
    try:
        r = lint(["."], expect_exit=2)  # an unreadable folder is an error; the rest is still linted
        assert found(r) == [*GOOD, "secret.py:1 AMP002"]
        assert "secret.py:1:1: AMP002 cannot read the file: Permission denied" in r.stdout
        assert one_line_errors(r) == ["ampdoctor: error: locked: cannot list folder (Permission denied)"]
        r = lint(["secret.py", "good.py"], expect_exit=1)
        assert found(r) == [*GOOD, "secret.py:1 AMP002"]
        # the text format, which shows source lines, copes too
        r = CliRunner().invoke(main, ["lint", "--no-cache", "-j", "1", "secret.py"])
        assert r.exit_code == 1 and "Traceback" not in r.output and "AMP002" in r.stdout
    finally:
        Path("locked").chmod(0o755)


# the installed console script: ``python -m`` would put the linted folder first on sys.path
AMPDOCTOR = [str(Path(sys.executable).with_name("ampdoctor"))]
if not Path(AMPDOCTOR[0]).exists():  # pragma: no cover - not installed as a script
    AMPDOCTOR = [sys.executable, "-P", "-m", "ampdoctor"]


def lint_process(args, cwd, timeout=120, cache=False):
    """``ampdoctor lint`` in a subprocess (so that a hang fails the test instead of the run)."""
    try:
        out = subprocess.run([*AMPDOCTOR, "lint", *([] if cache else ["--no-cache"]), "--format", "concise",
                              *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ampdoctor lint {' '.join(args)} hung for {timeout} s")
    assert "Traceback" not in out.stderr, out.stderr
    return out


def test_a_fifo_or_device_named_py_is_not_read(proj):
    """Reading a FIFO waits for a writer and /dev/zero never ends: a folder holding one hung."""
    os.mkfifo("pipe.py")
    os.symlink("/dev/zero", "zero.py")
    out = lint_process(["."], proj, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "good.py:7:5: AMP101" in out.stdout and "pipe.py" not in out.stdout and "zero.py" not in out.stdout
    out = lint_process(["pipe.py", "good.py"], proj, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "ampdoctor: error: pipe.py: not a regular file or folder\n"
    assert "good.py:7:5: AMP101" in out.stdout
    from ampdoctor.lint.runner import _read
    assert _read(Path("pipe.py")) == "not a regular file"
    assert _read(Path("zero.py")) == "not a regular file"


def test_a_fifo_gitignore_is_not_read(proj):
    (proj / ".git").mkdir()
    os.mkfifo(".gitignore")
    out = lint_process(["."], proj, timeout=60)
    assert out.returncode == 1 and "good.py:7:5: AMP101" in out.stdout


def test_broken_symlink(proj):
    os.symlink("nowhere.py", "broken.py")
    r = lint(["."], expect_exit=1)
    assert found(r) == ["broken.py:1 AMP002", *GOOD]
    assert "No such file or directory" in r.stdout
    r = lint(["broken.py"], expect_exit=1)
    assert found(r) == ["broken.py:1 AMP002"]
    lint(["--fix", "--unsafe-fixes", "broken.py"], expect_exit=1)
    assert not Path("nowhere.py").exists()


def test_symlink_loops(proj):
    """A loop of file links inside a linted folder used to end the whole run in an internal error."""
    os.symlink("loop_b.py", "loop_a.py")
    os.symlink("loop_a.py", "loop_b.py")
    Path("sub").mkdir()
    os.symlink("..", "sub/up")            # a folder loop
    os.symlink("..", "sub/up.py")         # a folder loop named like a file
    r = lint(["."], expect_exit=1)
    assert found(r) == [*GOOD, "loop_a.py:1 AMP002", "loop_b.py:1 AMP002"]
    assert "Too many levels of symbolic links" in r.stdout
    r = lint(["loop_a.py", "sub"], expect_exit=1)
    assert found(r) == ["loop_a.py:1 AMP002"]


def test_a_path_that_does_not_exist(proj):
    r = lint(["nope.py", "good.py", "missing/"], expect_exit=2)
    assert one_line_errors(r) == ["ampdoctor: error: nope.py: no such file or directory",
                                  "ampdoctor: error: missing/: no such file or directory"]
    assert found(r) == GOOD


def test_a_folder_of_10000_files(proj):
    big = proj / "many"
    for i in range(10_000):
        d = big / f"d{i // 1000}"
        if i % 1000 == 0:
            d.mkdir(parents=True)
        (d / f"m{i}.py").write_text(WRONG if i % 500 == 0 else f"x = {i}\n")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "ampdoctor", "lint", "--format", "json", "-j", "2", "--cache-dir",
           str(proj / "cache"), "many"]
    out = subprocess.run(cmd, cwd=proj, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["summary"]["files"] == 10_000
    assert len(doc["diagnostics"]) == 2 * 20
    again = subprocess.run(cmd, cwd=proj, capture_output=True, text=True, timeout=300)  # from the cache
    assert again.returncode == 1 and again.stdout == out.stdout
    assert time.monotonic() - start < 240


@pytest.mark.parametrize("toml, message", [
    ('[tool.ampdoctor]\nselect = 5\n', "'select' must be a list of strings"),
    ('[tool.ampdoctor]\nselect = ["AMP999"]\n', "unknown rule code 'AMP999'"),
    ('[tool.ampdoctor]\nselect = [""]\n', "unknown rule code ''"),
    ('[tool.ampdoctor]\nbogus = 1\n', "unknown key 'bogus'"),
    ('[tool.ampdoctor\nselect = []\n', "invalid TOML"),
    ('[tool]\nampdoctor = 3\n', "must be a table"),
    ('[tool]\nampdoctor = [1, 2]\n', "must be a table"),
    ('[tool.ampdoctor]\nper-file-ignores = 3\n', "'per-file-ignores' must be a table"),
    ('[tool.ampdoctor]\nper-file-ignores = {"x.py" = 5}\n', "must be a list of strings"),
    ('[tool.ampdoctor]\nper-file-ignores = {"x.py" = ["AMP9"]}\n', "unknown rule code 'AMP9'"),
    ('[tool.ampdoctor]\nmin-torch-version = "banana"\n', "min-torch-version must look like"),
    ('[tool.ampdoctor]\nmin-torch-version = [2]\n', "'min-torch-version' must be a quoted string"),
    ('[tool.ampdoctor]\nmin-torch-version = 2.10\n', "got the float 2.1 (quote it"),
    ('[tool.ampdoctor]\nselect = "AMP1"\n', "'select' must be a list of strings, e.g. select = [\"AMP1\"]"),
    ('[tool.ampdoctor]\nselect = ["AMP9"]\n', "pyproject.toml: unknown rule code 'AMP9'"),
    ('[tool.ampdoctor]\nexclude = [1]\n', "'exclude' must be a list of strings"),
    ('[tool.ampdoctor]\nignore = {a = 1}\n', "'ignore' must be a list of strings"),
])
def test_invalid_config_table_is_one_line_exit_2(proj, toml, message):
    Path("pyproject.toml").write_text(toml)
    r = lint(["."], expect_exit=2)
    [line] = one_line_errors(r)
    assert message in line and "internal error" not in line, line
    assert "pyproject.toml" in line, line  # every config error names its file
    assert r.stdout == ""


def test_config_that_is_not_utf8_is_a_config_error(proj):
    Path("pyproject.toml").write_bytes(b'[tool.ampdoctor]\nselect = ["\xff"]\n')
    r = lint(["."], expect_exit=2)
    [line] = one_line_errors(r)
    assert "internal error" not in line


def test_config_that_is_not_utf8_still_exits_2_in_one_line(proj):
    Path("pyproject.toml").write_bytes(b'[tool.ampdoctor]\nselect = ["\xff"]\n')
    r = lint(["."], expect_exit=2)
    assert len(one_line_errors(r)) == 1


def test_missing_or_broken_config_file_option(proj):
    r = lint(["--config", "nope.toml", "."], expect_exit=2)
    assert one_line_errors(r) == ["ampdoctor: error: cannot read nope.toml: No such file or directory"]
    Path("bad.toml").write_text("[tool.ampdoctor]\nselect = 1\n")
    r = lint(["--config", "bad.toml", "."], expect_exit=2)
    assert len(one_line_errors(r)) == 1


@pytest.mark.parametrize("option", ["--select", "--extend-select", "--ignore"])
@pytest.mark.parametrize("value", ["AMP999", "FOO", "AMP1,XYZ", "E501"])
def test_unknown_code_on_the_command_line(proj, option, value):
    r = lint([option, value, "."], expect_exit=2)
    [line] = one_line_errors(r)
    assert "unknown rule code" in line
    assert r.stdout == ""


def test_bad_usage_is_exit_2_without_traceback(proj):
    for args in (["-j", "0", "."], ["--format", "xml", "."], ["--unsafe-fixes", "."], ["-", "good.py"],
                 ["--min-torch-version", "two", "."], ["--fail-on", "fatal", "."]):
        r = lint(args, expect_exit=2)
        assert r.stdout == "" or "Usage" in r.output


def test_binary_on_standard_input(proj):
    r = lint(["-"], input=b"scaler.step(opt)\n\xff\xfe\x00", expect_exit=1)
    assert found(r) == ["-:1 AMP002"]


# -- nothing lost ---------------------------------------------------------------------------------

def test_fix_is_atomic_keeps_mode_and_owner(proj):
    p = Path("good.py")
    p.chmod(0o751)
    if os.geteuid() == 0:
        os.chown(p, 4321, 4322)
    inode = p.stat().st_ino
    lint(["--fix", "--unsafe-fixes", "good.py"], expect_exit=0)
    st = p.stat()
    assert p.read_text() == RIGHT
    assert stat.S_IMODE(st.st_mode) == 0o751
    assert st.st_ino != inode  # replaced by a rename, not rewritten in place
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (4321, 4322)
    assert sorted(x.name for x in proj.iterdir()) == ["good.py"]  # no temporary files left


def test_a_failed_write_leaves_the_file_and_reports_what_is_in_it(proj, monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    r = lint(["--fix", "--unsafe-fixes", "good.py"], expect_exit=1)
    assert Path("good.py").read_text() == WRONG
    assert found(r) == ["good.py:1 AMP002", *GOOD]  # the findings are still reported
    assert "cannot write the fixed file: No space left on device" in r.stdout
    assert "Fixed" not in r.stdout
    assert sorted(x.name for x in proj.iterdir()) == ["good.py"]


def test_fix_does_not_write_through_or_replace_a_symlink(proj):
    """Replacing a link turned it into a copy (the file it pointed to kept the bug)."""
    outside = proj / "outside"
    outside.mkdir()
    (outside / "real.py").write_text(WRONG)
    Path("pkg").mkdir()
    os.symlink(outside / "real.py", "pkg/link.py")
    r = lint(["--fix", "--unsafe-fixes", "pkg"], expect_exit=1)
    assert Path("pkg/link.py").is_symlink()
    assert (outside / "real.py").read_text() == WRONG
    assert "pkg/link.py:1:1: AMP002 cannot write the fixed file: it is a symbolic link" in r.stdout
    assert found(r) == ["pkg/link.py:1 AMP002", "pkg/link.py:7 AMP101", "pkg/link.py:8 AMP401"]


def test_fix_does_not_bypass_a_read_only_file(proj):
    """The rename used to replace files whose permissions say they are not to be written."""
    Path("good.py").chmod(0o444)
    r = lint(["--fix", "--unsafe-fixes", "good.py"], expect_exit=1)
    assert Path("good.py").read_text() == WRONG
    assert "cannot write the fixed file: it is read-only" in r.stdout
    assert found(r) == ["good.py:1 AMP002", *GOOD]


def test_fix_never_touches_broken_files_or_files_outside_the_paths(proj):
    Path("pkg").mkdir()
    Path("pkg/broken.py").write_text(WRONG + "def (:\n")
    Path("pkg/named.py").write_text(WRONG)
    Path("pkg/other.py").write_text(WRONG)
    Path("pkg/.venv").mkdir()
    Path("pkg/.venv/pyvenv.cfg").write_text("")
    Path("pkg/.venv/lib.py").write_text(WRONG)
    Path("pkg/excluded").mkdir()
    Path("pkg/excluded/ex.py").write_text(WRONG)
    Path("pyproject.toml").write_text('[tool.ampdoctor]\nextend-exclude = ["pkg/excluded/"]\n')
    before = {p: p.read_bytes() for p in Path(".").rglob("*.py")}
    r = lint(["--fix", "--unsafe-fixes", "pkg/named.py", "pkg/broken.py"], expect_exit=1)
    assert found(r) == ["pkg/broken.py:9 AMP000"]
    after = {p: p.read_bytes() for p in Path(".").rglob("*.py")}
    assert {p for p in before if before[p] != after[p]} == {Path("pkg/named.py")}
    r = lint(["--fix", "--unsafe-fixes", "--force-exclude", "pkg/excluded/ex.py", "pkg"], expect_exit=1)
    final = {p: p.read_bytes() for p in Path(".").rglob("*.py")}
    assert {p for p in before if before[p] != final[p]} == {Path("pkg/named.py"), Path("pkg/other.py")}


def _snapshot(root: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_diff_writes_nothing_and_applies_cleanly(proj, newline):
    src = ("import torch\n\x0c\n# \x1c \x85 \u2028 odd characters\n" + WRONG.replace(
        "    torch.cuda.empty_cache()", "    x = 1  # \x1c \x85 \u2028 \x0c\n    torch.cuda.empty_cache()"
    )).replace("\n", newline)
    Path("odd.py").write_bytes(src.encode())
    Path("broken.py").write_text(WRONG + "def (:\n")
    before = _snapshot(proj)
    r = CliRunner().invoke(main, ["lint", "--diff", "--unsafe-fixes", "."])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert _snapshot(proj) == before  # no file written, no cache folder, no temporary file
    diff = r.stdout_bytes  # (Result.stdout turns CRLF into LF)
    assert b"\\ No newline at end of file" not in diff
    assert diff.count(b"--- a/") == 2  # good.py and odd.py; never the broken file
    if shutil.which("patch") is None:  # pragma: no cover
        pytest.skip("patch is not installed")
    out = subprocess.run(["patch", "-p1", "--binary"], input=diff, cwd=proj, capture_output=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert b"offset" not in out.stdout and b"fuzz" not in out.stdout, out.stdout
    assert Path("good.py").read_text() == RIGHT
    fixed = lint_bytes("odd.py", src.encode(), UNSAFE).fixed
    assert fixed is not None and b"\x1c" in fixed
    assert Path("odd.py").read_bytes() == fixed


def _copy_corpus(root: Path, n: int) -> None:
    files = sorted((FIXTURES / "lint").glob("*.py")) + sorted((FIXTURES / "fix").glob("*.py"))
    for i in range(n):
        d = root / f"d{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(files[i % len(files)], d / f"f{i}.py")


def test_concurrent_runs_share_a_cache_without_corrupting_it(tmp_path):
    """Two runs at once on a few hundred files with one --cache-dir: from an empty cache, a full
    one, and one where part of the files changed. The last writer wins; nothing is corrupted."""
    corpus = tmp_path / "corpus"
    _copy_corpus(corpus, 240)
    cache = tmp_path / "cache"
    base = [*AMPDOCTOR, "lint", "--format", "json", "--select", "ALL", "-j", "2", "corpus"]

    def reference():
        out = subprocess.run(base + ["--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr
        assert json.loads(out.stdout)["summary"]["files"] == 240
        return out

    expected = reference()
    cmd = base + ["--cache-dir", str(cache)]
    for round_ in range(3):
        if round_ == 2:  # part of the files changed: each process meets a half-valid cache
            for f in sorted(corpus.rglob("f1*.py"))[:40]:
                f.write_text(f.read_text() + "\n# changed\n")
            expected = reference()
        procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (stdout, stderr) in zip(procs, outs):
            assert "Traceback" not in stderr and p.returncode == expected.returncode, stderr
            assert stdout == expected.stdout
        [cache_file] = [f for f in cache.iterdir() if f.suffix == ".json"]
        doc = json.loads(cache_file.read_text())
        assert isinstance(doc["files"], dict) and len(doc["files"]) >= 200
        assert not [f for f in cache.iterdir() if f.name.startswith(".tmp-")]
    third = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (third.returncode, third.stdout) == (expected.returncode, expected.stdout)


@pytest.mark.parametrize("damage", [
    lambda e: "not a list",
    lambda e: [e[0]],
    lambda e: [e[0], "diagnostics"],
    lambda e: [e[0], [5]],
    lambda e: [e[0], [{"code": "AMP101"}]],
    lambda e: [e[0], [dict(e[1][0], line="7")]],
    lambda e: [e[0], [dict(e[1][0], line=None)]],
    lambda e: [e[0], [dict(e[1][0], message=["x"])]],
    lambda e: [e[0], [dict(e[1][0], severity="fatal")]],
    lambda e: [e[0], [dict(e[1][0], fix={"title": "x"})]],
    lambda e: [e[0], [dict(e[1][0], path=7)]],
    lambda e: [e[0], [dict(e[1][0], column=-3)]],
])
def test_a_corrupted_cache_entry_is_ignored_and_rewritten(proj, damage):
    args = ["lint", "--format", "concise", "good.py"]
    first = CliRunner().invoke(main, args)
    [cache_file] = [f for f in (proj / ".ampdoctor_cache").iterdir() if f.suffix == ".json"]
    doc = json.loads(cache_file.read_text())
    key = str((proj / "good.py").resolve())
    good_entry = doc["files"][key]
    doc["files"][key] = damage(good_entry)
    cache_file.write_text(json.dumps(doc))
    r = CliRunner().invoke(main, args)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    assert (r.exit_code, r.stdout) == (first.exit_code, first.stdout)
    assert json.loads(cache_file.read_text())["files"][key] == good_entry


@pytest.mark.parametrize("garbage", [b"", b"{not json", b"[]", b'{"version": 1}', b"\xff\xfe\x00",
                                     b'{"version": "%s", "files": []}', b'{"version": "%s", "files": {"x": 1}}'])
def test_a_corrupted_cache_file_is_ignored_and_rewritten(proj, garbage):
    from ampdoctor import __version__
    args = ["lint", "--format", "concise", "good.py"]
    first = CliRunner().invoke(main, args)
    [cache_file] = [f for f in (proj / ".ampdoctor_cache").iterdir() if f.suffix == ".json"]
    cache_file.write_bytes(garbage.replace(b"%s", __version__.encode()))
    r = CliRunner().invoke(main, args)
    assert (r.exit_code, r.stdout) == (first.exit_code, first.stdout)
    assert str((proj / "good.py").resolve()) in json.loads(cache_file.read_text())["files"]


def test_cached_results_carry_this_runs_paths(proj):
    """The cache is shared by runs from any folder of the project: a run from a subfolder used to
    report the paths of the run that filled the cache."""
    Path("pyproject.toml").write_text("[tool.ampdoctor]\nignore = []\n")
    Path("pkg").mkdir()
    shutil.move("good.py", "pkg/good.py")
    r = CliRunner().invoke(main, ["lint", "--format", "concise", "pkg"])
    assert "pkg/good.py:7:5: AMP101" in r.stdout
    os.chdir("pkg")
    for fmt, expected in (("concise", "good.py:7:5: AMP101"), ("github", "file=good.py,line=7")):
        r = CliRunner().invoke(main, ["lint", "--format", fmt, "."])
        assert expected in r.stdout and "pkg/good.py" not in r.stdout, r.stdout
    assert (proj / ".ampdoctor_cache").is_dir() and not Path(".ampdoctor_cache").exists()


# -- security ------------------------------------------------------------------------------------------

def test_linting_never_imports_or_runs_the_code(proj):
    marker = proj / "MARKER"
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    Path("evil.py").write_text(
        f"import os\n{payload}"
        "import torch\n"
        f"class Meta(type):\n    def __init__(cls, *a):\n        {payload}"
        f"def __getattr__(name):\n    {payload}"
        "for batch in loader:\n    loss.backward()\n    torch.cuda.empty_cache()\n"
        f"if __name__ == '__main__':\n    {payload}")
    Path("conftest.py").write_text(payload + "scaler.step(opt)\n")
    Path("setup.py").write_text(payload + "scaler.step(opt)\n")
    Path("__init__.py").write_text(payload + "scaler.step(opt)\n")
    Path("sitecustomize.py").write_text(payload)
    Path("torch.py").write_text(payload)   # shadowing what a linter might import
    Path("libcst.py").write_text(payload)
    Path("pyproject.toml").write_text("[tool.ampdoctor]\nextend-select = ['AMP003']\n")
    for args in (["."], ["--fix", "--unsafe-fixes", "."], ["--diff", "."], ["--format", "json", "."],
                 ["--select", "ALL", "--format", "sarif", "."]):
        out = lint_process(args, proj)
        assert out.returncode in (0, 1, 2), out.stderr
        assert not marker.exists(), f"linting ran the code: {args}"
    r = lint(["--stdin-filename", "evil.py", "-"], input=Path("evil.py").read_text())
    assert not marker.exists()
    assert r.exit_code in (0, 1)


def test_the_cache_never_writes_through_a_symlinked_folder(proj):
    outside = proj.parent / (proj.name + "-outside")
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    os.symlink(outside, proj / ".ampdoctor_cache")
    before = _snapshot(outside)
    for _ in range(2):
        r = lint_process(["--format", "concise", "good.py"], proj, cache=True)
        assert r.returncode == 1 and "good.py:7:5: AMP101" in r.stdout
    assert _snapshot(outside) == before
    # a broken link to a folder that does not exist yet is not created either
    os.unlink(proj / ".ampdoctor_cache")
    os.symlink(outside / "new", proj / ".ampdoctor_cache")
    lint_process(["good.py"], proj, cache=True)
    assert not (outside / "new").exists()
    shutil.rmtree(outside)


def test_the_cache_never_writes_through_a_symlinked_cache_file(proj):
    r = lint_process(["good.py"], proj, cache=True)
    cache = proj / ".ampdoctor_cache"
    [cache_file] = [f for f in cache.iterdir() if f.suffix == ".json"]
    outside = proj.parent / (proj.name + "-target.json")
    outside.write_text("do not touch")
    cache_file.unlink()
    os.symlink(outside, cache_file)
    Path("good.py").write_text(WRONG + "\n")  # something new to cache
    for args in (["good.py"], ["--fix", "--unsafe-fixes", "good.py"]):
        r = lint_process(args, proj, cache=True)
        assert r.returncode in (0, 1), r.stderr
        assert outside.read_text() == "do not touch"
        assert cache_file.is_symlink()
    # a dangling link as the cache file: nothing is created where it points
    outside.unlink()
    Path("good.py").write_text(WRONG + "\n\n")
    lint_process(["good.py"], proj, cache=True)
    assert not outside.exists()


def test_the_cache_in_a_file_or_an_unwritable_place_is_skipped(proj):
    Path(".ampdoctor_cache").write_text("not a folder")
    r = lint_process(["--format", "concise", "good.py"], proj, cache=True)
    assert r.returncode == 1 and "good.py:7:5: AMP101" in r.stdout and r.stderr == ""
    assert Path(".ampdoctor_cache").read_text() == "not a folder"
    r = lint_process(["--format", "concise", "--cache-dir", "/proc/ampdoctor-cache", "good.py"], proj, cache=True)
    assert r.returncode == 1 and "good.py:7:5: AMP101" in r.stdout and r.stderr == ""


def test_no_thread_for_deep_nesting_is_a_diagnostic_not_a_crash(monkeypatch):
    import threading

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    limit = sys.getrecursionlimit()
    r = lint_bytes("deep.py", (LOOP + "x = " + "+".join(["a"] * 1000) + "\n").encode(), ALL)
    assert messages(r, "AMP001") == ["the file is nested too deeply to be checked"]
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize("fmt", ["text", "concise", "json", "sarif", "github"])
def test_every_format_copes_with_a_folder_of_hostile_files(proj, fmt):
    files = {
        "binary.py": bytes(range(256)) * 4 + b"scaler.step(opt)",
        "utf8_bad.py": WRONG.encode() + b"# \xff\n",
        "latin.py": ("# coding: latin-1\n# \xe9\n" + WRONG).encode("latin-1"),
        "bom.py": b"\xef\xbb\xbf" + WRONG.encode(),
        "crlf.py": WRONG.replace("\n", "\r\n").encode(),
        "cr.py": WRONG.replace("\n", "\r").encode(),
        "ff.py": ("\x0c\n\t\n" + WRONG).encode(),
        "nul.py": b"scaler.step(opt)\x00\n",
        "deep.py": ("scaler.step(opt)\nx = " + "[" * 1000 + "]" * 1000 + "\n").encode(),
        "eof.py": b"import torch\nfor batch in loader:\n    torch.cuda.empty_cache(\n",
        "empty.py": b"",
        "wide.py": (WRONG.replace("loss = model(batch)", "loss = model(batch)  # " + "\u4e2d" * 5000)).encode(),
    }
    for name, data in files.items():
        Path(name).write_bytes(data)
    os.symlink("nowhere.py", "broken.py")
    os.symlink("loop2.py", "loop1.py")
    os.symlink("loop1.py", "loop2.py")
    os.mkfifo("fifo.py")
    r = CliRunner().invoke(main, ["lint", "--no-cache", "-j", "1", "--format", fmt, "."])
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert r.exit_code == 1, r.output
    if fmt in ("json", "sarif"):
        doc = json.loads(r.stdout)
        if fmt == "json":
            paths = {d["path"] for d in doc["diagnostics"]}
            assert {"binary.py", "utf8_bad.py", "nul.py", "deep.py", "eof.py", "broken.py", "loop1.py"} <= paths
            assert not [d for d in doc["diagnostics"] if d["code"] == "AMP001"]
    if fmt in ("concise", "github"):
        assert all(line.count("\n") == 0 for line in r.stdout.splitlines())


def test_text_format_does_not_pass_terminal_escapes_through(proj):
    Path("esc.py").write_text("import torch\nfor batch in loader:\n    loss.backward()\n"
                              "    torch.cuda.empty_cache()  # \x1b]0;title\x07 \x1b[2J\n")
    r = CliRunner().invoke(main, ["lint", "--no-cache", "esc.py"])
    assert r.exit_code == 1
    assert "\x1b" not in r.stdout


@pytest.mark.parametrize("fmt", ["text", "concise", "json", "sarif", "github"])
def test_a_console_that_cannot_encode_the_report_still_gets_it(proj, fmt):
    """An ASCII or cp1252 standard output (a redirect on Windows) ended every run in an internal
    error: SARIF always has non-ASCII text, and file names may."""
    Path("café.py").write_text(WRONG)
    out = subprocess.run([*AMPDOCTOR, "lint", "--no-cache", "--format", fmt, "."], cwd=proj,
                         capture_output=True, env=dict(os.environ, PYTHONIOENCODING="ascii"), timeout=120)
    assert out.returncode == 1, out.stderr
    assert b"Traceback" not in out.stderr and b"internal error" not in out.stderr
    if fmt in ("json", "sarif"):
        doc = json.loads(out.stdout.decode("utf-8"))
        if fmt == "json":
            assert {d["path"] for d in doc["diagnostics"]} == {"café.py", "good.py"}
    else:
        assert b"good.py" in out.stdout and b"caf" in out.stdout


@pytest.mark.parametrize("fmt", ["concise", "json", "sarif"])
def test_a_file_name_that_is_not_utf8_in_an_output_file(proj, fmt):
    (proj / os.fsdecode(b"bad\xffname.py")).write_text(WRONG)
    r = lint(["--format", fmt, "-o", "report.out", "."], expect_exit=1)
    text = Path("report.out").read_text("utf-8")
    if fmt != "concise":
        doc = json.loads(text)
        if fmt == "json":
            assert {d["path"] for d in doc["diagnostics"]} == {"bad\udcffname.py", "good.py"}
    else:
        assert "bad\\udcffname.py:7:5: AMP101" in text
    assert r.stdout == ""
