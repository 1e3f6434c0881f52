"""Installation-level promises: no torch on the lint path, docs in the wheel, pre-commit hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import FIXTURES, ROOT

_BLOCK_TORCH = textwrap.dedent("""\
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch must not be imported by the linter")
            return None

    sys.meta_path.insert(0, _NoTorch())
    import ampdoctor
    from ampdoctor.cli import main
    sys.argv = ["ampdoctor", "lint", "--no-cache", "-j", "2", "--format", "sarif", %r]
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    assert "torch" not in sys.modules, "torch was imported"
    print("exit", code)
""")


def test_import_and_full_lint_run_never_import_torch():
    script = _BLOCK_TORCH % str(FIXTURES)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "exit 1"


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "rules"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "AMP101" in out.stdout


def test_wheel_carries_the_rule_docs(tmp_path):
    pytest.importorskip("hatchling")
    out = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("ampdoctor-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    docs = sorted(p.name for p in (ROOT / "rules").glob("*.md"))
    assert docs
    for name in docs:
        assert f"ampdoctor/_rules/{name}" in names
    assert "ampdoctor/cli.py" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any("torch" in r for r in requires), requires


def test_pre_commit_hooks_are_valid():
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    by_id = {h["id"]: h for h in hooks}
    assert set(by_id) == {"ampdoctor", "ampdoctor-fix"}
    for h in hooks:
        assert set(h) >= {"id", "name", "entry", "language", "types"}
        assert h["language"] == "python" and h["types"] == ["python"]
        assert h["entry"].startswith("ampdoctor lint")
        assert "--force-exclude" in h["entry"]
    assert "--fix" in by_id["ampdoctor-fix"]["entry"]


def test_hook_entry_with_no_python_files_does_not_crash(tmp_path):
    (tmp_path / "README.md").write_text("nothing to lint\n")
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "lint", "--force-exclude"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "ampdoctor: warning: no Python files found under .\n"


def _section(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    return text[text.index(start) + len(start): text.index(end)]


def test_readme_rule_table_is_current():
    readme = ROOT / "README.md"
    text = readme.read_text("utf-8")
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "rules", "--format", "markdown"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    if os.environ.get("AMPDOCTOR_UPDATE_README"):
        text = text.replace("<!-- rules:start -->\n" + _section(text, "rules"), "<!-- rules:start -->\n" + out)
        readme.write_text(text, "utf-8")
    assert _section(text, "rules") == out, "run: AMPDOCTOR_UPDATE_README=1 python -m pytest tests/test_packaging.py"


def test_readme_setup_commands_and_ci_agree():
    text = (ROOT / "README.md").read_text("utf-8")
    assert "pip install . && ampdoctor lint fixtures/example/" in text
    assert "pip install -e '.[test]' && python -m pytest -q" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci


def test_rule_catalog_is_current():
    from ampdoctor.lint import registry

    current = (ROOT / "src" / "ampdoctor" / "lint" / "catalog.py").read_text()
    assert current == registry.catalog_source(), "run: python -m ampdoctor.lint.registry"


def test_a_fully_cached_run_never_imports_libcst(tmp_path):
    src = (FIXTURES / "lint" / "seed_loop_wrong.py").read_text()
    (tmp_path / "a.py").write_text(src)
    cmd = [sys.executable, "-m", "ampdoctor", "lint", "--format", "concise", "a.py"]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    probe = ("import runpy, sys\nsys.argv = ['ampdoctor', 'lint', '--format', 'concise', 'a.py']\n"
             "try:\n    runpy.run_module('ampdoctor', run_name='__main__')\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('LIBCST' if 'libcst' in sys.modules else 'NO-LIBCST', code)\n")
    second = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert second.stdout.splitlines()[-1] == "NO-LIBCST 1"
    assert first.stdout in second.stdout
