"""Every rule has a doc in rules/ whose Example triggers it and whose Use instead does not."""

from __future__ import annotations

import pytest

from ampdoctor import docs
from ampdoctor.lint.registry import all_infos, rule_classes
from conftest import lint_text

SECTIONS = ["What it does", "Why is this bad?", "Fix safety", "References"]
CODES = sorted(all_infos())
RULE_CODES = sorted(r.code for r in rule_classes())


@pytest.mark.parametrize("code", CODES)
def test_doc_exists_with_front_matter_and_sections(code):
    text = docs.read(code)
    assert text is not None, f"rules/{code}.md is missing"
    meta, body = docs.split_front_matter(text)
    info = all_infos()[code]
    assert meta.get("code") == code
    assert meta.get("name") == info.name
    assert meta.get("severity") == info.severity.value
    assert meta.get("fix") == (info.fix or "none")
    assert body.startswith(f"# {info.name} ({code})")
    secs = docs.sections(body)
    for s in SECTIONS:
        assert s in secs and secs[s], f"{code}: section '{s}' is missing or empty"


@pytest.mark.parametrize("code", RULE_CODES)
def test_example_triggers_exactly_this_rule(code):
    meta, body = docs.split_front_matter(docs.read(code))
    secs = docs.sections(body)
    example = docs.code_block(secs.get("Example", ""))
    assert example, f"{code}: no Example code block"
    got = {d.code for d in lint_text(example).diagnostics}
    # a rule about the deprecated API cannot show its defect without the deprecation: the doc
    # names such codes in its front matter (`also-reported: AMP501`)
    also = {c.strip() for c in meta.get("also-reported", "").split(",") if c.strip()}
    assert got == {code} | also, f"{code}: Example gives {sorted(got)}"


@pytest.mark.parametrize("code", RULE_CODES)
def test_use_instead_does_not_trigger_it(code):
    _, body = docs.split_front_matter(docs.read(code))
    secs = docs.sections(body)
    good = docs.code_block(secs.get("Use instead", ""))
    assert good, f"{code}: no 'Use instead' code block"
    got = {d.code for d in lint_text(good).diagnostics}
    assert code not in got and not any(c.startswith("AMP00") for c in got), f"{code}: Use instead gives {sorted(got)}"


def test_every_doc_belongs_to_a_rule():
    d = docs.docs_dir()
    orphans = sorted(p.stem for p in d.glob("*.md") if p.stem not in all_infos())
    assert not orphans
