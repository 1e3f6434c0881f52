"""Fuzzing the linter: whatever bytes it is given, ``lint_bytes`` answers and fixes stay sound.

Three sources of input, each checked against the same invariants (``check``):

* mutations of the fixture files under ``fixtures/lint`` and ``fixtures/fix`` (truncation,
  deleted/duplicated/swapped lines, byte flips, random indentation, stray tokens);
* ``amp_modules``: a small grammar of the code the rules look at (GradScaler loops, autocast
  blocks, masked fills, ...) nested in random compound statements, with one-line bodies,
  semicolons, suppressions, tabs and CRLF, so that rules *and their fixes* see odd shapes;
* ``hypothesmith.from_grammar()``: arbitrary Python from the official grammar, with AMP code
  spliced in so the byte pre-filter does not skip it.

Invariants, for every input:

* ``lint_bytes`` never raises and never reports AMP001 (an internal error);
* every diagnostic is well formed (known code, 1-based positions, end after start);
* a file Python cannot parse gets AMP000 (or AMP002 when it cannot be decoded), a file it can
  parse gets neither;
* with ``fix="unsafe"`` the fixed source parses (for libcst and for Python), no diagnostic with
  an applicable fix is left, and linting the fixed source again changes nothing and reports
  the same diagnostics;
* every fix offered without ``--fix`` turns the source into code that parses.

The fast slice runs in the normal test run (derandomized, so it is reproducible); the same tests
with many more cases run with ``--run-slow``. Each test records how many cases it ran; the counts
are printed at the end of the module (``fuzz cases: ...``).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import tokenize
import warnings
from collections import Counter
from pathlib import Path

import libcst as cst
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ampdoctor.lint.engine import Settings, decode, lint_bytes
from ampdoctor.lint.registry import all_infos
from conftest import FIXTURES

# generated code trips Python's own warnings ("'int' object is not callable")
pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")

CODES = frozenset(all_infos())
ALL = Settings(enabled=CODES)
UNSAFE = Settings(enabled=CODES, fix="unsafe")
SAFE = Settings(enabled=CODES, fix="safe")

FAST = int(os.environ.get("AMPDOCTOR_FUZZ_FAST", "100"))
SLOW = int(os.environ.get("AMPDOCTOR_FUZZ_SLOW", "2500"))

CASES: Counter = Counter()


def _fast(n: int = FAST):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _slow(n: int = SLOW):
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def _report_cases(request):
    yield
    if CASES:
        line = "fuzz cases: " + ", ".join(f"{k}={v}" for k, v in sorted(CASES.items()))
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line("")
                reporter.write_line(line)
        out = os.environ.get("AMPDOCTOR_FUZZ_REPORT")
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")


# -- the invariants -------------------------------------------------------------------------

def _python_parses(data: bytes) -> bool:
    """Whether Python runs the file past parsing. ``ast.parse(bytes)`` alone is too lenient: it
    accepts invalid UTF-8 in comments, which ``python file.py`` refuses ("Non-UTF-8 code")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
            ast.parse(data.decode(encoding))
        except (SyntaxError, ValueError, LookupError, MemoryError, RecursionError):
            return False
    return True


def _cst_parses(data: bytes) -> bool:
    try:
        cst.parse_module(decode(data)[0])
    except Exception:
        return False
    return True


def _without_suppressions(data: bytes) -> bytes:
    return data.replace(b"ampdoctor", b"ampdoc_or").replace(b"noqa", b"no_a")


def _well_formed(result, path: str) -> None:
    for d in result.diagnostics:
        assert d.code in CODES, d
        assert d.path == path, d
        assert d.line >= 1 and d.column >= 1, d
        assert (d.end_line, d.end_column) >= (d.line, d.column), d
        assert d.message and "\n" not in d.message, d
    assert result.diagnostics == sorted(result.diagnostics)


def _no_internal_error(result, data: bytes) -> None:
    internal = [d.message for d in result.diagnostics if d.code == "AMP001"]
    assert not internal, f"AMP001 on input {data[:2000]!r}: {internal}"


def _apply_edits(text: str, edits) -> str:
    """Apply a Fix's edits (1-based line/column, end exclusive; lines end at \\r\\n, \\r or \\n)."""
    starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]

    def offset(line: int, col: int) -> int:
        assert 1 <= line <= len(starts), (line, len(starts))
        return starts[line - 1] + col - 1

    out = text
    for e in sorted(edits, key=lambda e: (e.line, e.column), reverse=True):
        a, b = offset(e.line, e.column), offset(e.end_line, e.end_column)
        assert 0 <= a <= b <= len(out), (e, len(out))
        out = out[:a] + e.content + out[b:]
    return out


# Rule defects the fuzzer found that are not fixed yet: each is pinned by a strict xfail test, so
# its fix is noticed; the fuzzer tolerates one only where disabling that single rule makes the input
# pass, and counts it. (AMP101's fix, which never converged with two steps on one line, is fixed.)
KNOWN_DEFECTS: dict[str, str] = {}


def _without_known_defect(path: str, data: bytes, mode: Settings, kind: str):
    for code in KNOWN_DEFECTS:
        narrower = dataclasses.replace(mode, enabled=mode.enabled - {code})
        rf = lint_bytes(path, data, narrower)
        if not any(d.code == "AMP001" for d in rf.diagnostics):
            CASES[f"{kind}:known-{code}"] += 1
            return rf, narrower
    return lint_bytes(path, data, mode), mode


def check(data: bytes, kind: str, path: str = "fuzz.py") -> None:
    """Every invariant of the module docstring, for one input."""
    CASES[kind] += 1
    r = lint_bytes(path, data, ALL)
    _no_internal_error(r, data)
    _well_formed(r, path)
    if r.skipped:
        assert r.diagnostics == []
        return
    codes = {d.code for d in r.diagnostics}
    py_ok = _python_parses(data)
    if py_ok:
        assert not codes & {"AMP000", "AMP002"}, (data[:2000], r.diagnostics)
    elif not codes & {"AMP000", "AMP002"}:
        # a suppression comment on the error's line may hide AMP000 (by design); without them,
        # a file that neither Python nor libcst can parse must be reported
        # (libcst accepts a little more than the running Python: newer syntax)
        unsuppressed = lint_bytes(path, _without_suppressions(data), ALL)
        if not {d.code for d in unsuppressed.diagnostics} & {"AMP000", "AMP002"}:
            assert _cst_parses(data), (data[:2000], r.diagnostics)
            CASES[kind + ":python-only-error"] += 1
    if codes & {"AMP000", "AMP002"}:
        # a broken file is never changed
        rf = lint_bytes(path, data, UNSAFE)
        assert rf.fixed is None
        return

    text = decode(data)[0]
    for d in r.diagnostics:
        if d.fix is not None:
            assert d.fix.edits
            CASES[kind + ":fix-offered"] += 1
            fixed_one = _apply_edits(text, d.fix.edits)
            cst.parse_module(fixed_one)  # the fix shown to users parses

    for mode in (UNSAFE, SAFE):
        rf = lint_bytes(path, data, mode)
        if any("did not converge" in m for m in (d.message for d in rf.diagnostics if d.code == "AMP001")):
            rf, mode = _without_known_defect(path, data, mode, kind)
        _no_internal_error(rf, data)
        _well_formed(rf, path)
        if rf.fixed is None:
            assert rf.fixes_applied == 0
            left = [d for d in rf.diagnostics if d.fix is not None and
                    (mode.fix == "unsafe" or d.fix.applicability.value == "safe")]
            assert not left, (data[:2000], left)
            continue
        CASES[kind + ":fixed"] += 1
        assert rf.fixes_applied > 0
        assert _cst_parses(rf.fixed), rf.fixed
        if py_ok:
            assert _python_parses(rf.fixed), rf.fixed
        applicable = [d for d in rf.diagnostics if d.fix is not None and
                      (mode.fix == "unsafe" or d.fix.applicability.value == "safe")]
        assert not applicable, (data[:2000], rf.fixed[:2000], applicable)
        again = lint_bytes(path, rf.fixed, mode)
        _no_internal_error(again, rf.fixed)
        assert again.fixed is None, (rf.fixed[:2000], again.fixed[:2000])
        assert again.diagnostics == rf.diagnostics
        plain = lint_bytes(path, rf.fixed, dataclasses.replace(mode, fix=None))
        assert [(d.line, d.code) for d in plain.diagnostics] == [(d.line, d.code) for d in rf.diagnostics]


# -- fixture mutations ------------------------------------------------------------------------

def _fixture_sources() -> list[bytes]:
    files = sorted((FIXTURES / "lint").glob("*.py")) + sorted((FIXTURES / "fix").glob("*.py"))
    return [f.read_bytes() for f in files]


SOURCES = _fixture_sources()
NOISE = [b"(", b")", b"[", b"]", b":", b"\\", b'"', b"'''", b"#", b"\t", b"\x0c", b"\r", b"\x00",
         b"\xff", b"\xef\xbb\xbf", b"lambda", b"async ", b"await ", b"yield", b" if ", b" else ",
         b"scaler.step(opt)", b"scaler.update()", b"torch.cuda.empty_cache()", b"loss.backward()",
         b"with torch.autocast('cuda'):", b"# ampdoctor: ignore[AMP", b"# noqa: AMP401", b"pass"]


@st.composite
def mutated_fixture(draw) -> bytes:
    data = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.integers(1, 4))):
        lines = data.split(b"\n")
        op = draw(st.sampled_from(["truncate", "delete", "duplicate", "swap", "flip", "indent",
                                   "insert", "join", "crlf"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        j = draw(st.integers(0, max(0, len(lines) - 1)))
        if op == "truncate":
            data = data[:draw(st.integers(0, len(data)))]
            continue
        if op == "flip":
            if data:
                k = draw(st.integers(0, len(data) - 1))
                data = data[:k] + bytes([data[k] ^ (1 << draw(st.integers(0, 7)))]) + data[k + 1:]
            continue
        if op == "crlf":
            data = data.replace(b"\n", draw(st.sampled_from([b"\r\n", b"\r"])))
            continue
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "indent":
            lines[i] = draw(st.sampled_from([b"", b" ", b"  ", b"    ", b"\t", b"        ", b" \t"])) + lines[i].lstrip()
        elif op == "insert":
            line = lines[i]
            k = draw(st.integers(0, len(line)))
            lines[i] = line[:k] + draw(st.sampled_from(NOISE)) + line[k:]
        elif op == "join" and i + 1 < len(lines):
            lines[i:i + 2] = [lines[i] + draw(st.sampled_from([b"; ", b" ", b""])) + lines[i + 1].lstrip()]
        data = b"\n".join(lines)
    return data


# -- a grammar of AMP code ----------------------------------------------------------------------

IMPORTS = [
    "import torch", "import torch.nn.functional as F", "from torch import nn",
    "from torch.cuda.amp import autocast, GradScaler", "from torch.amp import autocast, GradScaler",
    "import torch.cuda.amp as amp", "from torch import autocast", "import math",
]
SIMPLE = [
    "scaler = torch.amp.GradScaler('cuda')", "scaler = GradScaler()", "scaler = torch.cuda.amp.GradScaler()",
    "scaler = torch.cuda.amp.GradScaler(enabled=use_amp)", "scaler = GradScaler(enabled=False)",
    "scaler.scale(loss).backward()", "scaler.step(optimizer)", "scaler.update()", "scaler.unscale_(optimizer)",
    "loss = model(batch)", "loss = model(batch).mean()", "loss = criterion(model(x), y) / accum",
    "loss.backward()", "model(batch).sum().backward()", "optimizer.step()", "optimizer.zero_grad()",
    "torch.cuda.empty_cache()", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    "scores = scores.masked_fill(mask == 0, -1e9)", "x = x.masked_fill(~mask, float('-inf'))",
    "x = torch.where(mask, x, float('-inf'))", "attn = attn.masked_fill(mask, -65504.0)",
    "m = torch.finfo(x.dtype).min + torch.finfo(x.dtype).min", "bias = torch.finfo(torch.float16).min",
    "model = model.half()", "model.to(torch.float16)", "x = x.half()", "x = x.to(dtype=torch.bfloat16)",
    "torch.set_default_dtype(torch.float16)", "y = x.var(dim=0, dtype=torch.float32)",
    "s = x.std(0, dtype=torch.float32)", "eps = 1e-8", "opt = torch.optim.Adam(model.half().parameters(), eps=1e-8)",
    "torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict()}, path)",
    "loss = F.binary_cross_entropy(torch.sigmoid(p), t)", "crit = nn.BCELoss()",
    "bad = torch.isnan(loss).any()", "x[x != x] = 0", "assert not torch.isnan(loss).any()",
    "dtype = torch.get_autocast_gpu_dtype()", "name = torch.cuda.get_device_name()",
    "use_bf16 = torch.cuda.is_bf16_supported()", "y = x.type_as(z)", "z = torch.zeros(3, dtype=x.dtype)",
    "grads = torch.autograd.grad(loss, params)", "t5 = T5ForConditionalGeneration.from_pretrained('t5-small')",
    "pass", "return loss", "break", "continue", "del scaler", "global scaler", "yield loss",
    "x = lambda: scaler.step(optimizer)", "print(f'{loss=} {scaler.get_scale()}')", "...",
]
HEADERS = [
    "for batch in loader:", "for epoch in range(epochs):", "for i, (x, y) in enumerate(loader):",
    "while True:", "while step < total:", "if use_amp:", "if not use_amp:", "if precision == 'fp16':",
    "with torch.autocast('cuda', dtype=torch.float16):", "with torch.autocast('cuda', dtype=torch.bfloat16):",
    "with torch.autocast(device_type='cuda'):", "with autocast():", "with torch.cuda.amp.autocast():",
    "with torch.autocast('cuda', enabled=False):", "with torch.no_grad():", "with torch.set_grad_enabled(False):",
    "def train(model, loader, optimizer, scaler):", "def step(self, batch):", "async def run():",
    "class Trainer:", "class F(torch.autograd.Function):", "try:", "with open(p) as f, torch.autocast('cuda'):",
    "if torch.isnan(loss):",
]
CLAUSES = {"if": ["else:", "elif other:"], "try": ["except RuntimeError:", "finally:", "except Exception as e:"],
           "for": ["else:"], "while": ["else:"]}
COMMENTS = ["", "", "", "  # ampdoctor: ignore[AMP401]", "  # noqa: AMP101", "  # ampdoctor: ignore",
            "  # note", "  # noqa: E501", "  # ampdoctor: ignore[AMP1, AMP4]"]


def _simple_line(draw) -> str:
    parts = draw(st.lists(st.sampled_from(SIMPLE), min_size=1, max_size=3))
    sep = draw(st.sampled_from(["; ", ";", "; "]))
    line = sep.join(parts)
    if draw(st.integers(0, 9)) == 0:
        line += ";"
    if draw(st.integers(0, 14)) == 0 and "(" in line:
        k = line.index("(") + 1
        line = line[:k] + "\n" + draw(st.sampled_from(["", "    ", "        "])) + line[k:]
    return line + draw(st.sampled_from(COMMENTS))


def _block(draw, depth: int, unit: str) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 9)) if depth < 4 else 0
        if kind <= 4:
            out.extend(_simple_line(draw).split("\n"))
        elif kind == 5:
            out.append(draw(st.sampled_from(HEADERS)) + " " + _simple_line(draw).split("\n")[0])
        else:
            header = draw(st.sampled_from(HEADERS))
            out.append(header + draw(st.sampled_from(COMMENTS)))
            if draw(st.integers(0, 5)) == 0:
                out.append(draw(st.sampled_from(["", "# a comment", unit + "# indented comment"])))
            out.extend(unit + ln if ln else ln for ln in _block(draw, depth + 1, unit))
            keyword = header.split()[0]
            for clause in draw(st.lists(st.sampled_from(CLAUSES.get(keyword, ["else:"])), max_size=2)) \
                    if keyword in CLAUSES else ():
                out.append(clause)
                out.extend(unit + ln if ln else ln for ln in _block(draw, depth + 1, unit))
            if keyword == "try" and not any(c.startswith(("except", "finally")) for c in out[-6:]):
                out.append("finally:")
                out.append(unit + "pass")
        if draw(st.integers(0, 4)) == 0:
            out.append("")
    return out


@st.composite
def amp_modules(draw) -> bytes:
    unit = draw(st.sampled_from(["    ", "  ", "\t", " ", "        "]))
    lines = draw(st.lists(st.sampled_from(IMPORTS), max_size=3, unique=True))
    if draw(st.booleans()):
        lines.insert(0, draw(st.sampled_from(['"""Docstring."""', "# -*- coding: utf-8 -*-",
                                                "from __future__ import annotations", "#!/usr/bin/env python"])))
    lines += _block(draw, 0, unit)
    newline = draw(st.sampled_from(["\n", "\n", "\n", "\r\n"]))
    text = newline.join(lines)
    if draw(st.integers(0, 4)):
        text += newline
    data = text.encode("utf-8")
    if draw(st.integers(0, 19)) == 0:
        data = b"\xef\xbb\xbf" + data
    return data


# -- hypothesmith ---------------------------------------------------------------------------------

try:
    import hypothesmith
except ImportError:  # pragma: no cover - listed in the test extra
    hypothesmith = None

needs_hypothesmith = pytest.mark.skipif(hypothesmith is None, reason="hypothesmith is not installed")

AMP_SNIPPET = ("import torch\nscaler = torch.amp.GradScaler('cuda')\nfor batch in loader:\n"
               "    with torch.autocast('cuda', dtype=torch.float16):\n        loss = model(batch)\n"
               "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    torch.cuda.empty_cache()\n")


def _splice(args) -> bytes:
    code, where = args
    if where == "before":
        text = AMP_SNIPPET + code
    elif where == "after":
        text = code + ("" if code.endswith("\n") or not code else "\n") + AMP_SNIPPET
    else:  # only the pre-filter words, in a comment: every rule runs on the generated code
        words = " ".join(sorted({w.decode() for cls in _rule_classes() for w in cls.words}))
        text = f"# {words}\n" + code
    return text.encode("utf-8", "surrogatepass")


def grammar_with_amp():
    # built once: hypothesmith compiles the grammar each time a strategy is made
    return st.tuples(hypothesmith.from_grammar(), st.sampled_from(["before", "after", "comment"])).map(_splice)


def _rule_classes():
    from ampdoctor.lint.registry import rule_classes
    return rule_classes()


# -- the tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("src", [
    "import torch\nscaler = torch.amp.GradScaler()\nscaler.step(optimizer); scaler.step(optimizer)\n",
    "scaler.step(optimizer); x = lambda: scaler.step(optimizer)\n",
])
def test_amp101_fix_converges_with_two_steps_on_one_line(src):
    r = lint_bytes("a.py", src.encode(), UNSAFE)
    assert not [d.message for d in r.diagnostics if d.code == "AMP001"]



def test_fixture_sources_exist():
    assert len(SOURCES) >= 20


def test_unmodified_fixtures_hold_the_invariants():
    for data in SOURCES:
        check(data, "fixture")


@_fast()
@given(mutated_fixture())
def test_fuzz_fixture_mutations(data):
    check(data, "mutation")


@_fast()
@given(amp_modules())
def test_fuzz_amp_grammar(data):
    check(data, "amp-grammar")


GRAMMAR = grammar_with_amp() if hypothesmith is not None else st.nothing()


@needs_hypothesmith
@_fast(max(5, FAST // 2))
@given(GRAMMAR)
def test_fuzz_hypothesmith(data):
    check(data, "hypothesmith")


@_fast()
@given(st.binary(max_size=400).map(lambda b: b"scaler.step(opt)\n" + b))
def test_fuzz_random_bytes(data):
    check(data, "bytes")


@pytest.mark.slow
@_slow()
@given(mutated_fixture())
def test_fuzz_fixture_mutations_slow(data):
    check(data, "slow-mutation")


@pytest.mark.slow
@_slow()
@given(amp_modules())
def test_fuzz_amp_grammar_slow(data):
    check(data, "slow-amp-grammar")


@pytest.mark.slow
@needs_hypothesmith
@_slow(SLOW // 2)
@given(GRAMMAR)
def test_fuzz_hypothesmith_slow(data):
    check(data, "slow-hypothesmith")


@pytest.mark.slow
@_slow(SLOW // 2)
@given(st.binary(max_size=2000).map(lambda b: b"scaler.step(opt)\n" + b))
def test_fuzz_random_bytes_slow(data):
    check(data, "slow-bytes")
