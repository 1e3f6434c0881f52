"""Suppression comments: ``# ampdoctor: ignore[CODE, ...]``, ``# noqa: CODE``, ``# ampdoctor: ignore-file``.

A bare ``# noqa`` is *not* honoured: it is usually meant for another tool (line length,
unused import) and would silently hide an AMP bug on the same line.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

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
