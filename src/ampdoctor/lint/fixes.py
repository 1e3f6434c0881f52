"""Fixes: applying CST edits, turning them into text edits, choosing non-overlapping ones."""

from __future__ import annotations

import difflib
import re
from typing import Iterable

import libcst as cst

from ampdoctor.diagnostics import Edit
from ampdoctor.lint.rule import FixSpec


class _Apply(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, object]) -> None:
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        rep = self.replacements.get(id(original_node))
        return updated_node if rep is None else rep


def _has_import(module: cst.Module, name: str) -> bool:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for s in stmt.body:
                if isinstance(s, cst.Import):
                    for a in s.names:
                        bound = a.asname.name.value if a.asname and isinstance(a.asname.name, cst.Name) \
                            else (cst.helpers.get_full_name_for_node(a.name) or "").split(".")[0]
                        if bound == name:
                            return True
    return False


def _add_import(module: cst.Module, name: str) -> cst.Module:
    """Insert ``import NAME`` after the module docstring, __future__ imports and leading imports."""
    body = list(module.body)
    idx = 0
    if body and isinstance(body[0], cst.SimpleStatementLine) and body[0].body and \
            isinstance(body[0].body[0], cst.Expr) and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        idx = 1
    while idx < len(body) and isinstance(body[idx], cst.SimpleStatementLine) and \
            all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in body[idx].body):
        idx += 1
    body.insert(idx, cst.parse_statement(f"import {name}\n", config=module.config_for_parsing))
    return module.with_changes(body=body)


def apply_fixes(module: cst.Module, fixes: Iterable[FixSpec]) -> str:
    replacements: dict[int, object] = {}
    imports: set[str] = set()
    for f in fixes:
        for node, rep in f.changes:
            replacements[id(node)] = rep
        imports.update(f.imports)
    new = module.visit(_Apply(replacements)) if replacements else module
    for name in sorted(imports):
        if not _has_import(new, name):
            new = _add_import(new, name)
    return new.code


# Python's line breaks (str.splitlines also splits at form feeds, \x1c-\x1e, \x85, \u2028, ...,
# which are not line breaks in source code, so positions after them would be lines too far)
_NEWLINE = re.compile(r"\r\n|\r|\n")
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def keep_final_cr(old: str, new: str) -> str:
    """libcst drops the line break at the end of a file whose lines end with a lone CR; put it back."""
    if old.endswith("\r") and new and not new.endswith(("\r", "\n")):
        return new + "\r"
    return new


def text_edits(old: str, new: str) -> tuple[Edit, ...]:
    """Minimal edits turning ``old`` into ``new``: changed line blocks, trimmed to the characters."""
    a = _LINE.findall(old)
    b = _LINE.findall(new)
    # only the lines between the common head and tail are compared: the matcher is quadratic in
    # repeated lines (blank lines, comments), and a fix is local
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    matcher = difflib.SequenceMatcher(None, a[head:len(a) - tail], b[head:len(b) - tail], autojunk=False)
    edits = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        i1, i2, j1, j2 = i1 + head, i2 + head, j1 + head, j2 + head
        old_text = "".join(a[i1:i2])
        new_text = "".join(b[j1:j2])
        p = 0
        while p < min(len(old_text), len(new_text)) and old_text[p] == new_text[p]:
            p += 1
        s = 0
        while s < min(len(old_text), len(new_text)) - p and old_text[-1 - s] == new_text[-1 - s]:
            s += 1
        start = _advance(i1 + 1, 1, old_text[:p])
        end = _advance(i1 + 1, 1, old_text[: len(old_text) - s])
        edits.append(Edit(start[0], start[1], end[0], end[1], new_text[p: len(new_text) - s]))
    return tuple(edits)


def _advance(line: int, col: int, text: str) -> tuple[int, int]:
    ends = [m.end() for m in _NEWLINE.finditer(text)]
    if ends:
        return line + len(ends), len(text) - ends[-1] + 1
    return line, col + len(text)


def select_non_overlapping(fixable, allow_unsafe: bool) -> list:
    """The ``(diagnostic, FixSpec, span)`` entries to apply together: no two spans overlap."""
    chosen: list = []
    taken: list[tuple[int, int, int, int]] = []
    for entry in sorted(fixable, key=lambda f: f[2]):
        _, spec, span = entry
        if not spec.safe and not allow_unsafe:
            continue
        lo, hi = span[:2], span[2:]
        if any(not (hi <= t[:2] or lo >= t[2:]) for t in taken):
            continue
        chosen.append(entry)
        taken.append(span)
    return chosen
