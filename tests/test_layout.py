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


# -- the trace report -------------------------------------------------------------------------

TRACE_SCENARIOS = sorted((FIXTURES / "trace").glob("*.py"))


@pytest.fixture(scope="module")
def trace_reports():
    pytest.importorskip("torch")
    import json

    from click.testing import CliRunner

    from ampdoctor.cli import main

    import subprocess
    import sys

    reports = {}
    for script in TRACE_SCENARIOS:
        args = ["trace", "--format", "json", "--ops", str(script)]
        if "init_process_group" in script.read_text():
            # a process group of one: in a process of its own, not in the test runner's
            out = subprocess.run([sys.executable, "-m", "ampdoctor", *args], capture_output=True, text=True,
                                 timeout=240).stdout
        else:
            out = CliRunner().invoke(main, args).stdout
        reports[script.stem] = json.loads(out)
    return reports


def _render_trace(report, width: int) -> list[str]:
    from ampdoctor.report import trace_text

    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, force_terminal=False, highlight=False, emoji=False,
                      soft_wrap=True)
    trace_text.render(console, report)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", WIDTHS)
def test_trace_text_fits_and_keeps_every_number_and_name_whole(trace_reports, width):
    from ampdoctor.report import trace_text

    for name, report in trace_reports.items():
        lines = _render_trace(report, width)
        for ln in lines:
            assert len(ln) <= width, (name, width, ln)
        words = [set(ln.split()) for ln in lines]
        prose = [trace_text.verdict(report)] + [f["message"] for f in report["findings"]]
        for text in prose:
            for word in text.split():
                assert any(word in ws for ws in words), (name, width, word)
        rows = trace_text.table_rows(report)
        start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["module", "pass"]
                     or ln.split()[:2] == ["module", "class"])
        for r, ln in zip(rows, lines[start + 1:]):
            cells = ln.split()
            for value in (trace_text._absmax(r), trace_text._num(r["min_nonzero"]), trace_text._nonfinite(r)):
                assert value in cells, (name, width, value, ln)  # a number is never split
            assert trace_text.middle(r["module"], 10**6) == r["module"]
            assert any(c == r["module"] or "…" in c for c in cells), (name, width, r["module"], ln)
            assert (ln.startswith(">") == bool(r.get("origin"))), (name, ln)  # the origin is marked


def test_trace_table_keeps_backward_rows_with_only_inf(trace_reports):
    from ampdoctor.report import trace_text

    report = trace_reports["scaler_skips"]
    rows = trace_text.table_rows(report)
    assert any(r["phase"] == "backward" and r["nonfinite"]["pinf"] + r["nonfinite"]["ninf"] and not r["nonfinite"]["nan"]
               for r in rows)


def test_trace_output_file_is_what_the_terminal_shows_and_the_terminal_gets_the_verdict(tmp_path):
    pytest.importorskip("torch")
    from click.testing import CliRunner

    from ampdoctor.cli import main

    script = str(FIXTURES / "trace" / "fp16_linear_overflow.py")
    out = tmp_path / "r.txt"
    r = CliRunner().invoke(main, ["trace", "--width", "80", "-o", str(out), script])
    assert r.stdout.splitlines() == ["NaN/Inf first appeared in `blowup` (forward, step 0).", f"wrote {out}"]
    shown = CliRunner().invoke(main, ["trace", "--width", "80", script]).stdout
    assert out.read_text() == shown
    assert max(len(ln) for ln in shown.splitlines()) <= 80
    html = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["trace", "--format", "html", "-o", str(html), script])
    assert r.stdout.splitlines()[-1] == f"wrote {html}" and html.read_text().startswith("<!doctype html>")


def test_long_module_paths_are_shortened_in_the_middle_to_fit():
    from ampdoctor.report import trace_text

    name = "model.encoder.layers.11.self_attention.query_key_value.lora_A.default"
    row = {"module": name, "class": "LoRALinearWithAVeryLongClassName", "phase": "backward",
           "dtype": "float16", "absmax": None, "min_nonzero": 0.000488281, "headroom_bits": None,
           "nonfinite": {"nan": 3, "pinf": 12, "ninf": 0}, "overflow_fraction": 0.5,
           "underflow_fraction": 0.0123, "calls": 40, "origin": True}
    for width in WIDTHS:
        head, line = trace_text.layer_table([row], width)
        assert len(line) <= width and len(head) <= width
        cells = line.split()
        assert cells[0] == ">" and "0.000488" in cells and "3/12" in cells and "nan" in cells
        short = cells[1]
        assert short.endswith("default") and "…" in short and "11" in short, short


@pytest.mark.parametrize("width", [10, 16, 20, 28])
def test_shortened_sibling_layers_stay_apart(width):
    """Rows of sibling layers differ in the layer index and the tail; shortening keeps both."""
    from ampdoctor.report import trace_text

    families = [[f"transformer.h.{i}.attn.c_attn" for i in (0, 1, 11)],
                [f"model.encoder.layers.{i}.self_attention.query_key_value.lora_A.default" for i in (0, 1, 11)],
                [f"encoder.block.{i}.layer.1.DenseReluDense.wo" for i in (0, 3)]]
    for names in families:
        short = [trace_text.middle(n, width) for n in names]
        assert all(len(s) <= width for s in short), short
        assert len(set(short)) == len(names), short


# -- the HTML report in a real browser -----------------------------------------------------------

ARTIFACTS = ROOT / "build" / "test-artifacts"


def _chromium():
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.parametrize("scenario", ["scaler_skips", "fp16_linear_overflow"])
def test_html_report_renders_in_a_headless_browser(scenario, tmp_path):
    """The page loads with no console error, shows the origin and the backward rows, and a
    screenshot is kept under build/test-artifacts/ for a person to look at."""
    pytest.importorskip("torch")
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on this machine")
    import subprocess

    from click.testing import CliRunner

    from ampdoctor.cli import main

    page = tmp_path / f"{scenario}.html"
    r = CliRunner().invoke(main, ["trace", "--format", "html", "-o", str(page),
                                  str(FIXTURES / "trace" / f"{scenario}.py")])
    assert r.exit_code in (0, 1), r.output
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}"]
    dom = subprocess.run([browser, *flags, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console_errors = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln and ("Error" in ln or "Uncaught" in ln)]
    assert not console_errors, console_errors
    html = dom.stdout
    assert "backward (gradients)" in html and 'class="bar' in html
    assert "<td>backward</td>" in html and "None" not in html.split('id="report-data"')[0]
    if scenario == "fp16_linear_overflow":
        assert 'tr class="origin"' in html and 'class="bar origin"' in html  # the origin stands out
    else:
        assert "loss scale per step" in html
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"trace-{scenario}.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1400,1600", page.as_uri()],
                   capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_shortened_sibling_layers_stay_apart():
    """`transformer.h.0.mlp.c_fc` and `transformer.h.1.mlp.c_fc` differ only near the end: the
    shortened names must keep that part (GPT-2 from a config showed two identical rows)."""
    from ampdoctor.report import trace_text

    def row(name):
        return {"module": name, "class": "NewGELUActivation", "phase": "backward", "dtype": "float16",
                "absmax": None, "min_nonzero": 3.05e-05, "headroom_bits": None,
                "nonfinite": {"nan": 131072, "pinf": 0, "ninf": 0}, "overflow_fraction": 0.0,
                "underflow_fraction": 0.00597, "calls": 4, "origin": False}

    names = ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc", "transformer.h.1.attn.c_attn"]
    for width in WIDTHS:
        lines = trace_text.layer_table([row(n) for n in names], width)[1:]
        shown = [ln.split()[0] for ln in lines]
        assert len(set(shown)) == len(names), (width, shown)


@pytest.mark.parametrize("width", WIDTHS)
def test_merged_multi_rank_trace_text_fits(trace_reports, width):
    """A report merged from two ranks (each scenario's report as rank 0 and rank 1) has a rank
    line per rank, a rank on each finding and a rank column, all within the width."""
    from ampdoctor.trace import distributed as dt

    for name, report in trace_reports.items():
        merged = dt.merge({0: report, 1: report}, 2)
        lines = _render_trace(merged, width)
        assert all(len(ln) <= width for ln in lines), (name, width, [ln for ln in lines if len(ln) > width])
        for r in (0, 1):
            assert any(ln.startswith(f"  rank {r}: ") for ln in lines), (name, r, lines)
        if merged["findings"]:
            assert any("rank 0" in ln for ln in lines if " · " in ln), name
        header = next((ln for ln in lines if ln.split()[:2] == ["rank", "module"]), None)
        assert header is not None, (name, width)


@pytest.fixture(scope="module")
def mode_reports():
    """The watch and compare fixtures, traced in their own modes."""
    pytest.importorskip("torch")
    import json

    from click.testing import CliRunner

    from ampdoctor.cli import main

    out = {}
    for name, args in {"watch": ["--watch", "--watch-steps", "3", str(FIXTURES / "trace" / "watch_bad_batch.py")],
                       "compare": ["--compare", "fp32", str(FIXTURES / "trace" / "compare_lossy_shift.py")]}.items():
        res = CliRunner().invoke(main, ["trace", "--format", "json", *args])
        out[name] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_watch_and_compare_sections_fit_and_keep_words_and_numbers_whole(mode_reports, width):
    from ampdoctor.report import trace_text

    watch = _render_trace(mode_reports["watch"], width)
    line = trace_text.watch_line(mode_reports["watch"])
    assert line and line.startswith("watch: step 30:")
    compare = mode_reports["compare"]
    lines = _render_trace(compare, width)
    for name, shown, prose in (("watch", watch, [line]),
                               ("compare", lines, [r["advice"] for r in compare["compare"]["layers"][:1]])):
        assert all(len(ln) <= width for ln in shown), (name, width, [ln for ln in shown if len(ln) > width])
        words = [set(ln.split()) for ln in shown]
        for text in prose:
            for word in text.split():
                assert any(word in ws for ws in words), (name, width, word)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("precision against float32"))
    rows = [r for r in compare["compare"]["layers"] if not r["container"]]
    assert rows[0]["module"] == "shift"
    for r, ln in zip(rows, lines[start + 2:]):
        cells = ln.split()
        assert cells[0] == r["module"] and trace_text._num(r["own_rel_err"]) in cells, (width, ln)
        assert trace_text._num(r["bits_lost"]) in cells, (width, ln)
