"""A trace report as the text, JSON or HTML a user reads, and writing it to a file."""

from __future__ import annotations

import io
import json
import os


def format_for(path: str, fmt: str | None = None) -> str:
    """``fmt``, else the format a file name asks for (``.json``, ``.html``/``.htm``, else text)."""
    if fmt:
        return fmt
    ext = os.path.splitext(path)[1].lower()
    return {".json": "json", ".html": "html", ".htm": "html"}.get(ext, "text")


def render(report: dict, fmt: str, width: int = 100) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2) + "\n"
    if fmt == "html":
        from ampdoctor.report import trace_html
        return trace_html.render(report)
    from ampdoctor.report import trace_text
    buf = io.StringIO()
    trace_text.render(console(buf, width, plain=True), report)
    return buf.getvalue()


def console(file, width: int | None, plain: bool):
    """The console a trace report is printed on: plain (no colour, no terminal codes) for a file
    or a pipe, so that it holds exactly what a terminal of that width shows."""
    from rich.console import Console

    return Console(file=file, width=width, highlight=False, emoji=False, no_color=plain or None,
                   force_terminal=False if plain else None, soft_wrap=True)


def write(report: dict, path: str, fmt: str | None = None, width: int = 100) -> str:
    """Write the report to ``path`` (atomically) in ``fmt`` or the format its name asks for."""
    text = render(report, format_for(path, fmt), width)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
