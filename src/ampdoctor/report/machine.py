"""Machine-readable lint output: json, concise, github, sarif."""

from __future__ import annotations

import json
from collections import Counter
from typing import Iterable

from ampdoctor import __version__, docs
from ampdoctor.diagnostics import Diagnostic, RuleInfo, Severity, fix_counts


def summary(diags: list[Diagnostic], files: int, fixed: int) -> dict:
    safe, unsafe = fix_counts(diags)
    return {
        "files": files,
        "files_with_diagnostics": len({d.path for d in diags}),
        "diagnostics": len(diags),
        "fixed": fixed,
        "fixable": safe,
        "unsafe_fixable": unsafe,
        "by_severity": {s.value: sum(1 for d in diags if d.severity is s) for s in Severity},
        "by_code": dict(sorted(Counter(d.code for d in diags).items())),
    }


def to_json(diags: list[Diagnostic], files: int, fixed: int, unreferenced=(), applied=()) -> str:
    doc = {
        "version": __version__,
        "diagnostics": [d.to_dict() for d in diags],
        "summary": summary(diags, files, fixed),
        # with --fix: the diagnostics whose fixes were applied, where they were before the fix
        "applied": [{"code": d.code, "name": d.name, "path": d.path, "line": d.line, "column": d.column}
                    for d in applied],
        # defect-rule findings in definitions nothing in the project refers to (not counted)
        "unreferenced": [{"code": h.diagnostic.code, "path": h.diagnostic.path, "line": h.diagnostic.line,
                          "column": h.diagnostic.column, "definition": h.where, "reason": h.kind}
                         for h in unreferenced],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def statistics_json(diags: list[Diagnostic]) -> str:
    """``--statistics --format json``: one object per rule (count, safe and unsafe fixable counts)."""
    from ampdoctor.report.text import statistics_rows
    return json.dumps(statistics_rows(diags), indent=2, ensure_ascii=False) + "\n"


def to_concise(diags: Iterable[Diagnostic]) -> str:
    return "".join(f"{d.path}:{d.line}:{d.column}: {d.code} {d.message}\n" for d in diags)


def _gh_escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_escape_prop(s: str) -> str:
    return _gh_escape_data(s).replace(":", "%3A").replace(",", "%2C")


_GH_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def to_github(diags: Iterable[Diagnostic]) -> str:
    lines = []
    for d in diags:
        props = (f"file={_gh_escape_prop(d.path)},line={d.line},col={d.column},"
                 f"endLine={d.end_line},endColumn={d.end_column},title={_gh_escape_prop(d.code + ' ' + d.name)}")
        lines.append(f"::{_GH_LEVEL[d.severity]} {props}::{_gh_escape_data(d.code + ' ' + d.message)}\n")
    return "".join(lines)


_SARIF_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _rule_descriptor(info: RuleInfo) -> dict:
    text = docs.read(info.code) or ""
    _, body = docs.split_front_matter(text)
    secs = docs.sections(body)
    full = secs.get("What it does", info.summary)
    desc = {
        "id": info.code,
        "name": info.name,
        "shortDescription": {"text": info.summary},
        "fullDescription": {"text": full},
        "defaultConfiguration": {"level": _SARIF_LEVEL[info.severity]},
        "properties": {"fix": info.fix or "none", "default": info.default, "tags": ["amp", info.severity.value]},
    }
    if body:
        desc["help"] = {"text": body, "markdown": body}
    return desc


def to_sarif(diags: list[Diagnostic], infos: dict[str, RuleInfo]) -> str:
    used = sorted({d.code for d in diags})
    codes = sorted(infos)
    index = {c: i for i, c in enumerate(codes)}
    results = []
    for d in diags:
        result = {
            "ruleId": d.code,
            "ruleIndex": index[d.code] if d.code in index else -1,
            "level": _SARIF_LEVEL[d.severity],
            "message": {"text": d.message},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": {"uri": d.path, "uriBaseId": "%SRCROOT%"},
                    "region": {"startLine": d.line, "startColumn": d.column,
                               "endLine": d.end_line, "endColumn": d.end_column},
                }
            }],
        }
        if result["ruleIndex"] < 0:
            del result["ruleIndex"]
        if d.fix is not None and d.fix.edits:
            result["fixes"] = [{
                "description": {"text": d.fix.title},
                "artifactChanges": [{
                    "artifactLocation": {"uri": d.path, "uriBaseId": "%SRCROOT%"},
                    "replacements": [{
                        "deletedRegion": {"startLine": e.line, "startColumn": e.column,
                                          "endLine": e.end_line, "endColumn": e.end_column},
                        "insertedContent": {"text": e.content},
                    } for e in d.fix.edits],
                }],
            }]
        results.append(result)
    doc = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "ampdoctor",
                "version": __version__,
                "semanticVersion": __version__,
                "rules": [_rule_descriptor(infos[c]) for c in codes],
            }},
            "originalUriBaseIds": {"%SRCROOT%": {"description": {"text": "The folder ampdoctor ran in."}}},
            "columnKind": "unicodeCodePoints",
            "results": results,
            "properties": {"rulesWithResults": used},
        }],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
