"""Human-readable lint output rendered with rich: the line, a caret under the span, the help."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampdoctor.diagnostics import Diagnostic, RuleInfo, Severity, fix_counts

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


def _wrap(text: str, width: int, indent: str = "", first: str = "") -> list[str]:
    """Word-wrapped lines; a word longer than the line stays whole on a line of its own."""
    return textwrap.wrap(text, width=max(20, width), initial_indent=first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def _window(src: str, start: int, span: int, room: int) -> tuple[str, int, int]:
    """The part of a source line that fits ``room`` columns, around the flagged span: cut ends
    are marked with ``…`` so that the terminal never wraps (and breaks) the quoted code."""
    if len(src) <= room or room < 20:
        return src, start, min(span, max(1, len(src) - start)) if len(src) > start else span
    lo = max(0, min(start - 8, len(src) - room))
    if start - lo > room - 10:
        lo = start - 8
    text = src[lo: lo + room]
    left = lo > 0
    right = lo + room < len(src)
    if left:
        text = "…" + text[1:]
    if right:
        text = text[:-1] + "…"
    col = start - lo
    span = max(1, min(span, room - col - (1 if right else 0)))
    return text, col, span


def render_diagnostics(console: Console, diags: Iterable[Diagnostic], sources: dict[str, str] | None = None,
                       show_fixes: bool = False) -> None:
    cache: dict[str, list[str] | None] = {k: _split(v) for k, v in (sources or {}).items()}
    width = console.width
    for d in diags:
        style = _STYLE[d.severity]
        head = f"{d.path}:{d.line}:{d.column}:"
        lead = f"{head} {d.code} {d.name} "
        lines = _wrap(lead + d.message, width, indent="    ")
        first = lines[0]
        if first.startswith(lead):  # styled when the location and code fit on the first line
            rest = first[len(lead):]
            console.print(f"[bold]{escape(head)}[/bold] [{style}]{d.code}[/{style}] [dim]{d.name}[/dim] "
                          f"{escape(rest)}", highlight=False, soft_wrap=True)
        else:
            console.print(escape(first), highlight=False, soft_wrap=True)
        for line in lines[1:]:
            console.print(escape(line), highlight=False, soft_wrap=True)
        src = _source_line(cache, d.path, d.line)
        if src is not None:
            gutter = len(str(d.line))
            src = (src.expandtabs(4) if "\t" not in src[: d.column] else src).translate(_CONTROL).rstrip()
            span = (d.end_column - d.column) if d.end_line == d.line else max(1, len(src) - d.column + 1)
            src, start, span = _window(src, d.column - 1, max(1, span), width - gutter - 3)
            console.print(f"[blue]{' ' * gutter} |[/blue]", highlight=False)
            console.print(f"[blue]{d.line} |[/blue] {escape(src)}", highlight=False, soft_wrap=True)
            console.print(f"[blue]{' ' * gutter} |[/blue] {' ' * start}[{style}]{'^' * span}[/{style}]",
                          highlight=False, soft_wrap=True)
        if d.explanation:
            for line in _wrap(d.explanation, width, indent="  ", first="  "):
                console.print(escape(line), highlight=False, soft_wrap=True)
        if d.fix_title:
            kind = f" ({d.fix.applicability.value} fix)" if d.fix else ""
            lines = _wrap(f"{d.fix_title}{kind}", width, indent="          ", first="  = help: ")
            console.print(f"  [green]= help:[/green] {escape(lines[0][len('  = help: '):])}", highlight=False,
                          soft_wrap=True)
            for line in lines[1:]:
                console.print(escape(line), highlight=False, soft_wrap=True)
        if show_fixes and d.fix is not None:
            _render_edits(console, d)
        console.print()


def _render_edits(console: Console, d: Diagnostic) -> None:
    """The fix's edits, one `- old` / `+ new` pair per edit, under the diagnostic (``--show-fixes``)."""
    for e in d.fix.edits:
        where = f"{e.line}:{e.column}" + (f"-{e.end_line}:{e.end_column}" if (e.end_line, e.end_column) != (e.line, e.column) else "")
        if e.content:
            for i, line in enumerate(e.content.rstrip("\n").split("\n") or [""]):
                lead = f"  [green]+[/green] {where} " if i == 0 else "  [green]+[/green] " + " " * (len(where) + 1)
                console.print(f"{lead}{escape(line.translate(_CONTROL))}", highlight=False, soft_wrap=True)
        else:
            console.print(f"  [red]-[/red] {where} (deleted)", highlight=False, soft_wrap=True)


def clean_line(files: int, failed: bool) -> str | None:
    """What a run without diagnostics says: never "All checks passed" when a path failed or no file was found."""
    if files == 0:
        return None  # the errors or the "no Python files" warning on standard error say it
    plural = "s" * (files != 1)
    if failed:
        return f"No diagnostics in the {files} file{plural} checked, but some paths could not be checked (see above)."
    return f"All checks passed ({files} file{plural} checked)."


def fixable_line(diags: list[Diagnostic], fix_mode: str | None) -> str | None:
    """How many of the diagnostics a fix mode would fix, worded for the mode the run was in."""
    safe, unsafe = fix_counts(diags)
    if fix_mode == "unsafe":
        return None
    if fix_mode == "safe":  # what is left after --fix is unsafe only
        return f"{unsafe} more fixable with `--fix --unsafe-fixes`." if unsafe else None
    if safe and unsafe:
        return f"{safe} fixable with `--fix`; {unsafe} more with `--fix --unsafe-fixes`."
    if safe:
        return f"{safe} fixable with `--fix`."
    if unsafe:
        return f"{unsafe} fixable with `--fix --unsafe-fixes` (none with `--fix` alone)."
    return None


def render_summary(console: Console, diags: list[Diagnostic], files: int, fixed: int, fix_mode: str | None,
                   failed: bool = False) -> None:
    n = len(diags)
    if fixed:
        console.print(f"Fixed {fixed} diagnostic{'s' * (fixed != 1)}.", highlight=False)
    if n == 0:
        line = clean_line(files, failed)
        if line:
            console.print(f"[green]{escape(line)}[/green]" if not failed else escape(line), highlight=False)
        return
    by_sev = Counter(d.severity for d in diags)
    parts = ", ".join(f"{by_sev[s]} {s.value}{'s' * (by_sev[s] != 1)}" for s in Severity if by_sev[s])
    console.print(f"Found {n} diagnostic{'s' * (n != 1)} ({parts}) in {len({d.path for d in diags})} of {files} "
                  f"file{'s' * (files != 1)}.", highlight=False)
    line = fixable_line(diags, fix_mode)
    if line:
        console.print(escape(line), highlight=False)


def render_applied(console: Console, applied: list[Diagnostic]) -> None:
    """``--fix --show-fixes``: per file, how many fixes of each rule were applied."""
    console.print(f"Fixed {len(applied)} diagnostic{'s' * (len(applied) != 1)}:", highlight=False)
    by_path: dict[str, Counter] = {}
    names: dict[str, str] = {}
    for d in applied:
        by_path.setdefault(d.path, Counter())[d.code] += 1
        names[d.code] = d.name
    for path, counts in sorted(by_path.items()):
        console.print(f"  {escape(path)}:", highlight=False, soft_wrap=True)
        for code, k in sorted(counts.items()):
            console.print(f"    {k} × {code} ({names[code]})", highlight=False)
    console.print()


def statistics_rows(diags: list[Diagnostic]) -> list[dict]:
    """One row per rule: count, and how many have a safe or an unsafe fix; most frequent first."""
    rows: dict[str, dict] = {}
    for d in diags:
        row = rows.setdefault(d.code, {"code": d.code, "name": d.name, "count": 0, "fixable": 0, "unsafe_fixable": 0})
        row["count"] += 1
        if d.fix is not None:
            row["fixable" if d.fix.applicability.value == "safe" else "unsafe_fixable"] += 1
    return sorted(rows.values(), key=lambda r: (-r["count"], r["code"]))


def render_statistics(console: Console, diags: list[Diagnostic]) -> None:
    rows = statistics_rows(diags)
    if not rows:
        return
    table = Table(box=None, show_header=True, pad_edge=False, header_style="bold")
    for col, justify in (("count", "right"), ("code", "left"), ("fix", "left"), ("name", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    marks = set()
    for r in rows:
        mark = "[*]" if r["fixable"] else ("[-]" if r["unsafe_fixable"] else "")
        if mark:
            marks.add(mark)
        table.add_row(str(r["count"]), r["code"], escape(mark), r["name"])
    console.print(table)
    legend = []
    if "[*]" in marks:
        legend.append("[*] fixable with `--fix`")
    if "[-]" in marks:
        legend.append("[-] fixable with `--fix --unsafe-fixes` only")
    if legend:
        console.print(escape("; ".join(legend) + "."), highlight=False)
    console.print()


def render_rules(console: Console, infos: list[RuleInfo], enabled: set[str] | None = None) -> None:
    table = Table(title=None, show_lines=False)
    for col in ("code", "name", "severity", "fix", "default", "summary"):
        table.add_column(col, overflow="fold")
    for i in infos:
        table.add_row(i.code, i.name, i.severity.value, i.fix or "-", "yes" if i.default else "no", escape(i.summary))
    console.print(table)
