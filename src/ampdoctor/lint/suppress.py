"""Suppression comments: ``# ampdoctor: ignore[CODE, ...]``, ``# noqa: CODE``, ``# ampdoctor: ignore-file``.

A bare ``# noqa`` is *not* honoured: it is usually meant for another tool (line length,
unused import) and would silently hide an AMP bug on the same line.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

from ampdoctor.diagnostics import Diagnostic
from ampdoctor.lint.registry import UNUSED_SUPPRESSION, all_infos
from ampdoctor.lint.result import Settings
from ampdoctor.lint.result import diag_at as _diag_at

# a cheap look for comments that may concern ampdoctor; only then is the file tokenized
QUICK = re.compile(rb"#\s*ampdoctor\s*:|#\s*noqa\s*:[^\n]*AMP", re.I)
_AMPDOCTOR = re.compile(r"#\s*ampdoctor\s*:\s*(ignore-file|ignore)\b\s*(?:\[([^\]]*)\])?", re.I)
_NOQA = re.compile(r"#\s*noqa\s*:\s*([A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*)", re.I)
_CODE = re.compile(r"^AMP[0-9]*$")


@dataclass
class Suppression:
    line: int
    column: int  # 1-based column of the comment
    end_column: int
    codes: tuple[str, ...] | None  # None: every code
    file_level: bool
    used: set[str]

    def matches(self, code: str) -> str | None:
        """The entry of this suppression that covers ``code`` (``"*"`` for a bare one)."""
        if self.codes is None:
            return "*"
        for c in self.codes:
            if code.startswith(c):
                return c
        return None


def _split_codes(text: str) -> list[str]:
    return [c.strip().upper() for c in re.split(r"[\s,]+", text) if c.strip()]


def parse(text: str) -> list[Suppression]:
    """Every suppression comment in ``text`` (comments only, never inside strings)."""
    out: list[Suppression] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        line, col = tok.start
        comment = tok.string
        for m in _AMPDOCTOR.finditer(comment):
            kind, codes = m.group(1).lower(), m.group(2)
            parsed = tuple(_split_codes(codes)) if codes is not None else None
            out.append(Suppression(line, col + 1 + m.start(), col + 1 + m.end(), parsed,
                                   kind == "ignore-file", set()))
        for m in _NOQA.finditer(comment):
            ours = tuple(c for c in _split_codes(m.group(1)) if c.startswith("AMP"))
            if ours:
                out.append(Suppression(line, col + 1 + m.start(), col + 1 + m.end(), ours, False, set()))
    return out


def is_code_like(code: str) -> bool:
    return bool(_CODE.match(code))


def apply(path: str, text: str | None, data: bytes, diagnostics: list[Diagnostic],
          settings: Settings) -> list[Diagnostic]:
    """Drop the diagnostics a suppression comment covers and report unused suppressions (AMP003)."""
    if text is None or not QUICK.search(data):
        return diagnostics
    sups = parse(text)
    if not sups:
        return diagnostics
    kept = []
    for d in diagnostics:
        hit = False
        for s in sups:
            if s.file_level or s.line in (d.line, d.end_line):
                entry = s.matches(d.code)
                if entry is not None:
                    s.used.add(entry)
                    hit = True
        if not hit:
            kept.append(d)
    if UNUSED_SUPPRESSION.code in settings.enabled:
        known = all_infos()
        for s in sups:
            if s.codes is None:
                if not s.used:
                    kept.append(_diag_at(path, UNUSED_SUPPRESSION, s.line, s.column,
                                         "unused suppression: nothing is reported here",
                                         s.line, s.end_column))
                continue
            for c in s.codes:
                if c in s.used:
                    continue
                matching = [k for k in known if k.startswith(c)]
                if not matching:
                    msg = f"unused suppression: unknown code {c}"
                elif not any(k in settings.enabled for k in matching):
                    continue  # the code is not enabled in this run, so it may well be needed
                else:
                    msg = f"unused suppression: {c} is not reported here"
                kept.append(_diag_at(path, UNUSED_SUPPRESSION, s.line, s.column, msg, s.line, s.end_column))
    return kept
