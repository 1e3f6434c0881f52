"""Rule documentation: ``rules/CODE.md`` (shipped inside the wheel as ``ampdoctor/_rules``)."""

from __future__ import annotations

import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def docs_dir() -> Path | None:
    for candidate in (_HERE / "_rules", _HERE.parent.parent / "rules"):
        if candidate.is_dir():
            return candidate
    return None


def read(code: str) -> str | None:
    d = docs_dir()
    if d is None:
        return None
    p = d / f"{code.upper()}.md"
    try:
        return p.read_text("utf-8")
    except OSError:
        return None


def split_front_matter(text: str) -> tuple[dict[str, str], str]:
    meta: dict[str, str] = {}
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            for line in text[4:end].splitlines():
                if ":" in line:
                    k, v = line.split(":", 1)
                    meta[k.strip()] = v.strip()
            text = text[end + 5:]
    return meta, text.lstrip("\n")


def sections(body: str) -> dict[str, str]:
    """``## Heading`` -> its text."""
    out: dict[str, str] = {}
    parts = re.split(r"^## +(.+?)\s*$", body, flags=re.M)
    for i in range(1, len(parts) - 1, 2):
        out[parts[i].strip()] = parts[i + 1].strip()
    return out


def code_block(section: str) -> str | None:
    m = re.search(r"```(?:python|py)?\n(.*?)```", section, flags=re.S)
    return m.group(1) if m else None
