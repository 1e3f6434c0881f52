"""A rule's message, split into what users see on the location line and the explanation below it.

A rule writes one text: what is wrong, then why it matters and what to do. A text of at most
:data:`LIMIT` characters is kept whole; of a longer one, the first sentence
or clause (up to the first ``": "``, ``". "`` or ``"; "`` outside backticks, quotes and parentheses) is the
short message shown on the location line and in ``concise``, ``github`` and SARIF output; the
rest is the explanation that ``text`` output prints under the snippet and JSON carries as
``explanation``. A short message longer than :data:`LIMIT` has its longest quoted code elided in
the middle until it fits.
"""

from __future__ import annotations

import re

LIMIT = 100
_SPLITS = (": ", ". ", "; ")
_CODE = re.compile(r"`[^`]*`")


def _split_point(text: str) -> int:
    """Index of the first top-level separator, or -1."""
    tick = quote = False
    depth = 0
    for i, ch in enumerate(text):
        if ch == "`" and not quote:
            tick = not tick
        elif ch == '"' and not tick:
            quote = not quote
        elif tick or quote:
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(_SPLITS, i) and i > 0:
            return i
    return -1


def _elide(code: str, keep: int) -> str:
    """`` `a_long(call)` `` with its middle replaced by ``...`` so that it has ``keep`` characters."""
    inner = code[1:-1]
    keep = max(keep - 2, 24)
    if len(inner) <= keep:
        return code
    head = (keep - 3) * 2 // 3
    return f"`{inner[:head]}...{inner[len(inner) - (keep - 3 - head):]}`"


def fit(text: str, limit: int = LIMIT) -> str:
    """Elide the longest code spans of ``text`` until it is at most ``limit`` characters (if it can be)."""
    for _ in range(8):
        over = len(text) - limit
        if over <= 0:
            return text
        spans = sorted(_CODE.finditer(text), key=lambda m: len(m.group()), reverse=True)
        if not spans or len(spans[0].group()) <= 28:
            return text
        m = spans[0]
        text = text[: m.start()] + _elide(m.group(), len(m.group()) - over) + text[m.end():]
    return text


def split(message: str) -> tuple[str, str | None]:
    """``(short, explanation)``; the explanation is None when the message is short or one clause."""
    if len(message) <= LIMIT:
        return message, None
    i = _split_point(message)
    if i < 0:
        return fit(message.rstrip(".")), None
    short = message[:i].rstrip()
    rest = message[i + 2:].strip()
    if not rest:
        return fit(short), None
    first = rest.split(" ", 1)[0]
    if rest[0].islower() and not any(c.isdigit() or c in "_.()" for c in first):
        rest = rest[0].upper() + rest[1:]
    return fit(short), rest
