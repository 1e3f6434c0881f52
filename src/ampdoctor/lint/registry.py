"""Rule discovery and code selection."""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from typing import Iterable

from ampdoctor.diagnostics import AmpdoctorError, RuleInfo, Severity

# Codes the engine itself emits. They are not Rule classes but can be selected,
# ignored and suppressed like any rule.
SYNTAX_ERROR = RuleInfo("AMP000", "syntax-error", Severity.ERROR,
                        "The file could not be parsed.", None, True)
INTERNAL_ERROR = RuleInfo("AMP001", "internal-error", Severity.ERROR,
                          "A rule failed on this file; the file was not fully checked.", None, True)
READ_ERROR = RuleInfo("AMP002", "unreadable-file", Severity.ERROR,
                      "The file could not be read or decoded.", None, True)
UNUSED_SUPPRESSION = RuleInfo("AMP003", "unused-suppression", Severity.INFO,
                              "A suppression comment names a code that is not reported on its line.",
                              None, False)
ENGINE_CODES = (SYNTAX_ERROR, INTERNAL_ERROR, READ_ERROR, UNUSED_SUPPRESSION)


@lru_cache(maxsize=None)
def rule_classes() -> tuple[type, ...]:
    """Every Rule class shipped in ``ampdoctor.lint.rules``, sorted by code."""
    from ampdoctor.lint import rules as pkg
    from ampdoctor.lint.rule import Rule

    found = []
    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{pkg.__name__}.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Rule) and obj is not Rule and obj.__module__ == module.__name__:
                found.append(obj)
    found.sort(key=lambda r: r.code)
    codes = [r.code for r in found]
    dupes = {c for c in codes if codes.count(c) > 1}
    if dupes:  # pragma: no cover - a packaging bug, caught by the test suite
        raise RuntimeError(f"duplicate rule codes: {sorted(dupes)}")
    return tuple(found)


@lru_cache(maxsize=None)
def all_infos() -> dict[str, RuleInfo]:
    infos = {i.code: i for i in ENGINE_CODES}
    for r in rule_classes():
        infos[r.code] = r.info()
    return dict(sorted(infos.items()))


def expand(selector: str, *, what: str = "code") -> set[str]:
    """Codes matching a code, a code prefix or ALL. Unknown selectors raise."""
    sel = selector.strip().upper()
    codes = all_infos()
    if sel == "ALL":
        return set(codes)
    matched = {c for c in codes if c.startswith(sel)} if sel else set()
    if not matched:
        raise AmpdoctorError(f"unknown rule {what} '{selector.strip()}' (see `ampdoctor rules`)")
    return matched


def resolve_selection(layers: Iterable[tuple[list[str] | None, list[str], list[str]]]) -> frozenset[str]:
    """Apply (select, extend_select, ignore) layers in order, starting from the defaults.

    Each later layer (config, then command line) overrides the earlier one.
    """
    enabled = {c for c, i in all_infos().items() if i.default}
    for select, extend, ignore in layers:
        if select is not None:
            enabled = set().union(*(expand(s) for s in select)) if select else set()
        for s in extend:
            enabled |= expand(s)
        for s in ignore:
            enabled -= expand(s)
    return frozenset(enabled)
