"""Engine behaviour: encodings, robustness, pre-filter and determinism."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import FIXTURES
from ampdoctor.lint.engine import Settings, lint_bytes
from ampdoctor.lint.registry import all_infos

ALL = Settings(enabled=frozenset(all_infos()))
BODY = ("import torch\n"
        "for batch in loader:\n"
        "    loss = model(batch)\n"
        "    loss.backward()\n"
        "    torch.cuda.empty_cache()\n")


def codes(result):
    return [(d.line, d.code) for d in result.diagnostics]


def test_latin1_cookie_and_bom_are_honoured():
    latin = ("# -*- coding: latin-1 -*-\n# caf\xe9\n" + BODY).encode("latin-1")
    assert codes(lint_bytes("a.py", latin, ALL)) == [(7, "AMP401")]
    bom = b"\xef\xbb\xbf" + BODY.encode()
    assert codes(lint_bytes("b.py", bom, ALL)) == [(5, "AMP401")]


def test_undecodable_file_is_a_read_error():
    r = lint_bytes("c.py", BODY.encode() + b"# \xff\xfe\n", ALL)
    assert [d.code for d in r.diagnostics] == ["AMP002"]
    assert "cannot decode" in r.diagnostics[0].message


def test_nul_bytes_and_syntax_errors_are_syntax_diagnostics():
    r = lint_bytes("d.py", BODY.encode() + b"x = 1\x00\n", ALL)
    assert [d.code for d in r.diagnostics] == ["AMP000"]
    r = lint_bytes("e.py", BODY.encode() + b"def (:\n", ALL)
    assert [(d.line, d.code) for d in r.diagnostics] == [(6, "AMP000")]


def test_crlf_source_keeps_its_line_endings_when_fixed():
    src = BODY.replace("\n", "\r\n").encode()
    r = lint_bytes("f.py", src, Settings(enabled=ALL.enabled, fix="unsafe"))
    assert r.fixed is not None and b"empty_cache" not in r.fixed
    assert r.fixed.count(b"\r\n") == r.fixed.count(b"\n")


def test_prefilter_skips_files_without_rule_words():
    r = lint_bytes("g.py", b"def f(:\n  pass\n", ALL)
    assert r.skipped and r.diagnostics == []


def test_output_is_identical_across_hash_seeds_and_process_counts(tmp_path):
    corpus = tmp_path / "corpus"
    for i in range(40):  # enough files to use the process pool
        d = corpus / f"d{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        src = FIXTURES / "lint" / ("seed_loop_wrong.py" if i % 2 else "seed_loop_right.py")
        shutil.copy(src, d / f"f{i}.py")
    outputs = set()
    for seed, jobs in (("0", "1"), ("123", "2"), ("random", "2"), ("7", "1")):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-m", "ampdoctor", "lint", "--no-cache", "--format", "json",
                              "--include-unreferenced", "-j", jobs, "corpus"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 1, out.stderr
        outputs.add(out.stdout)
    assert len(outputs) == 1
    doc = json.loads(outputs.pop())
    assert doc["summary"]["files"] == 40 and doc["summary"]["diagnostics"] == 20 * 4


def _lint_grouped(monkeypatch, text: str, chunk: int | None = None):
    """Lint ``text`` as a large file (the thresholds lowered to its size): the result, and the
    source of each pass the engine parsed."""
    from ampdoctor.lint import engine

    monkeypatch.setattr(engine, "LARGE_FILE", 2_000)
    monkeypatch.setattr(engine, "LARGE_TREE", 100)
    if chunk is not None:
        monkeypatch.setattr(engine, "CHUNK_CHARS", chunk)
    passes: list[str] = []
    real = engine._lint_text
    monkeypatch.setattr(engine, "_lint_text", lambda *a: passes.append(a[1]) or real(*a))
    return lint_bytes("big.py", text.encode(), Settings(enabled=frozenset(all_infos()))), passes


def test_very_large_files_are_linted_in_groups_with_the_same_findings(monkeypatch):
    """A file over LARGE_FILE is parsed a group of top-level statements at a time (memory);
    statement-local findings and their positions are the same as in one pass, imports are
    reported once, and no fix is offered."""
    text = (FIXTURES / "lint" / "deprecated_device_amp.py").read_text("utf-8")
    text += "".join(f"\n\ndef filler_{i}(x):\n    return x * {i}\n" for i in range(200))
    whole = lint_bytes("big.py", text.encode(), Settings(enabled=frozenset(all_infos())))
    grouped, passes = _lint_grouped(monkeypatch, text, chunk=600)
    assert len(passes) > 3 and max(map(len, passes)) < len(text) / 3  # parsed in groups, never whole
    key = sorted((d.line, d.column, d.code, d.message) for d in whole.diagnostics)
    assert key and key == sorted((d.line, d.column, d.code, d.message) for d in grouped.diagnostics)
    assert all(d.fix is None for d in grouped.diagnostics)


def test_one_huge_literal_statement_is_linted_element_group_by_group(monkeypatch):
    """A single top-level list display larger than the group size (torch's 660 KB `op_db`) is cut
    between elements that start a line; findings inside the elements keep their lines and columns,
    and code after the list is still linted."""
    rows = [f"    dict(name='op{i}', fn=lambda x: x * {i}, dtypes=(torch.float32,)),\n" for i in range(400)]
    rows[150] = "    dict(name='amp', ctx=torch.cuda.amp.autocast(enabled=True)),\n"
    rows[399] = "    dict(name='last', scaler=torch.cuda.amp.GradScaler())]\n"  # closes on its own line
    after = (FIXTURES / "lint" / "deprecated_device_amp.py").read_text("utf-8")
    text = "import torch\n\nop_db: list = [\n" + "".join(rows) + "\n" + after
    whole = lint_bytes("big.py", text.encode(), Settings(enabled=frozenset(all_infos())))
    grouped, passes = _lint_grouped(monkeypatch, text, chunk=3_000)
    assert len(passes) > 5 and max(len(p) for p in passes) < 8_000  # never the whole list
    key = sorted((d.line, d.column, d.code) for d in whole.diagnostics)
    assert (154, 26, "AMP501") in key and any(line == 403 for line, _, _ in key)
    assert key == sorted((d.line, d.column, d.code) for d in grouped.diagnostics)


def test_a_generated_table_in_a_large_file_is_not_parsed(monkeypatch):
    """A top-level statement of pure constant data (a generated lookup table) holds nothing a
    rule looks at; in a large file it is skipped, and findings after it keep their lines."""
    table = "META = {\n" + "".join(f"    ({i}, torch.float16): ({i}, -{i}.5, 'x'),\n" for i in range(3000)) + "}\n"
    text = ("import torch\n\n" + table +
            (FIXTURES / "lint" / "deprecated_device_amp.py").read_text("utf-8"))
    grouped, passes = _lint_grouped(monkeypatch, text)
    assert passes and not any("META = {" in p for p in passes)
    offset = table.count("\n") + 2
    base = lint_bytes("small.py", (FIXTURES / "lint" / "deprecated_device_amp.py").read_bytes(),
                      Settings(enabled=frozenset(all_infos())))
    assert sorted((d.line - offset, d.code) for d in grouped.diagnostics) == sorted((d.line, d.code) for d in base.diagnostics)
