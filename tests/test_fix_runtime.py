"""Fixes that run: every scaler-protocol rule with an automatic fix, applied to a training script
that runs on CPU (torch's CPU GradScaler and float16 autocast), and the fixed script executed.

``fixtures/runtime/NAME.py`` is a complete script whose first line selects its rule. The test
applies ``--fix --unsafe-fixes``, checks the rule no longer fires, and runs the result: a fix
that produces code which fails at run time (a second ``update()`` with no step before it, a
clip that still sees scaled gradients) fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import FIXTURES, fixture_selection, lint_text

pytest.importorskip("torch")

SCRIPTS = sorted((FIXTURES / "runtime").glob("*.py"))
# the rules whose fixes these scripts cover; each must have one (a rule added later gets one too)
COVERED = {"AMP101", "AMP104", "AMP105", "AMP107", "AMP108"}


def _run(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)


def _fixed(text: str, name: str) -> str:
    result = lint_text(text, name, enabled=fixture_selection(text), fix="unsafe")
    assert result.fixed is not None, "no fix was applied"
    return result.fixed.decode("utf-8")


def test_every_scaler_rule_with_a_fix_has_a_runtime_script():
    from ampdoctor.lint.registry import all_infos

    with_fix = {c for c, i in all_infos().items() if c.startswith("AMP1") and i.fix in ("safe", "unsafe")}
    selected = {re.search(r"fixture-select:\s*(\S+)", p.read_text()).group(1) for p in SCRIPTS}
    assert with_fix == COVERED and selected == COVERED, (with_fix, selected)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_fixed_script_runs(script, tmp_path):
    text = script.read_text("utf-8")
    code = fixture_selection(text)
    before = lint_text(text, script.name, enabled=code)
    assert before.diagnostics, "the script has nothing to fix"
    fixed = _fixed(text, script.name)
    after = lint_text(fixed, script.name, enabled=code)
    assert not after.diagnostics, [d.message for d in after.diagnostics]
    out = tmp_path / script.name
    out.write_text(fixed, "utf-8")
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_original_scripts_of_raising_defects_really_raise(tmp_path):
    """The harness can fail: the unfixed scripts of the protocol errors raise on CPU."""
    for name, error in (("step_update_per_epoch", "step() has already been called"),
                        ("step_without_update", "step() has already been called"),
                        ("plain_backward", "_scale is None")):
        proc = _run(FIXTURES / "runtime" / f"{name}.py")
        assert proc.returncode != 0 and error in proc.stderr, (name, proc.stderr[-500:])


def test_an_update_that_is_not_moved_would_raise(tmp_path, monkeypatch):
    """Inserting `update()` after the step and keeping the per-epoch one raises at run time."""
    from ampdoctor.lint.rules import amp101_step_without_update as amp101

    monkeypatch.setattr(amp101, "reaches", lambda a, b: False)  # the fix as it was: insert only
    script = FIXTURES / "runtime" / "step_update_per_epoch.py"
    fixed = _fixed(script.read_text("utf-8"), script.name)
    assert fixed.count("scaler.update()") == 2
    out = tmp_path / script.name
    out.write_text(fixed, "utf-8")
    proc = _run(out)
    assert proc.returncode != 0 and "No inf checks were recorded prior to update" in proc.stderr
