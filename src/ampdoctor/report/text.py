"""Human-readable lint output rendered with rich: the line, a caret under the span, the help."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampdoctor.diagnostics import Diagnostic, RuleInfo, Severity

_LINES = re.compile(r"\r\n|\r|\n")  # what the parser counts as a line break (not form feeds)
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f] if c != 0x09}  # a linted file must not drive the terminal


def _split(text: str) -> list[str]:
    return _LINES.split(text)


_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def _source_line(cache: dict[str, list[str] | None], path: str, line: int) -> str | None:
    if path not in cache:
        try:
            with open(path, "rb") as f:
                data = f.read()
            from ampdoctor.lint.engine import decode
            cache[path] = _split(decode(data)[0])
        except Exception:
            cache[path] = None
    lines = cache[path]
    if lines is None or not (1 <= line <= len(lines)):
        return None
    return lines[line - 1]


def render_diagnostics(console: Console, diags: Iterable[Diagnostic], sources: dict[str, str] | None = None) -> None:
    cache: dict[str, list[str] | None] = {k: _split(v) for k, v in (sources or {}).items()}
    for d in diags:
        style = _STYLE[d.severity]
        console.print(
            f"[bold]{escape(d.path)}:{d.line}:{d.column}:[/bold] [{style}]{d.code}[/{style}] "
            f"[dim]{d.name}[/dim] {escape(d.message)}",
            highlight=False, soft_wrap=True,
        )
        src = _source_line(cache, d.path, d.line)
        if src is not None:
            gutter = len(str(d.line))
            src = (src.expandtabs(4) if "\t" not in src[: d.column] else src).translate(_CONTROL)
            width = (d.end_column - d.column) if d.end_line == d.line else max(1, len(src.rstrip()) - d.column + 1)
            console.print(f"[blue]{' ' * gutter} |[/blue]", highlight=False)
            console.print(f"[blue]{d.line} |[/blue] {escape(src)}", highlight=False, soft_wrap=True)
            console.print(f"[blue]{' ' * gutter} |[/blue] {' ' * (d.column - 1)}[{style}]{'^' * max(1, width)}[/{style}]",
                          highlight=False, soft_wrap=True)
        if d.fix_title:
            kind = f" ({d.fix.applicability.value} fix)" if d.fix else ""
            console.print(f"  [green]= help:[/green] {escape(d.fix_title)}{kind}", highlight=False, soft_wrap=True)
        console.print()


def render_summary(console: Console, diags: list[Diagnostic], files: int, fixed: int, fix_mode: str | None) -> None:
    n = len(diags)
    if fixed:
        console.print(f"Fixed {fixed} diagnostic{'s' * (fixed != 1)}.", highlight=False)
    if n == 0:
        console.print(f"[green]All checks passed[/green] ({files} file{'s' * (files != 1)} checked).", highlight=False)
        return
    by_sev = Counter(d.severity for d in diags)
    parts = ", ".join(f"{by_sev[s]} {s.value}{'s' * (by_sev[s] != 1)}" for s in Severity if by_sev[s])
    console.print(f"Found {n} diagnostic{'s' * (n != 1)} ({parts}) in {len({d.path for d in diags})} of {files} "
                  f"file{'s' * (files != 1)}.", highlight=False)
    safe = sum(1 for d in diags if d.fix and d.fix.applicability.value == "safe")
    unsafe = sum(1 for d in diags if d.fix and d.fix.applicability.value == "unsafe")
    if safe and fix_mode is None:
        console.print(f"{safe} fixable with `--fix`.", highlight=False)
    if unsafe and fix_mode != "unsafe":
        console.print(f"{unsafe} more fixable with `--fix --unsafe-fixes`.", highlight=False)


def render_statistics(console: Console, diags: list[Diagnostic]) -> None:
    counts = Counter((d.code, d.name) for d in diags)
    fixable = {d.code for d in diags if d.fix}
    table = Table(box=None, show_header=False, pad_edge=False)
    for (code, name), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(str(n), code, name, "[*]" if code in fixable else "")
    console.print(table)


def render_rules(console: Console, infos: list[RuleInfo], enabled: set[str] | None = None) -> None:
    table = Table(title=None, show_lines=False)
    for col in ("code", "name", "severity", "fix", "default", "summary"):
        table.add_column(col, overflow="fold")
    for i in infos:
        table.add_row(i.code, i.name, i.severity.value, i.fix or "-", "yes" if i.default else "no", escape(i.summary))
    console.print(table)
