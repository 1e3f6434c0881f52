"""Terminal summary of a trace report: the verdict first, then the findings and worst layers."""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.markup import escape

from ampdoctor.trace.formats import LOSSY_BITS


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _all_skipped(report: dict) -> bool:
    """The GradScaler skipped every optimizer step of the run (none went through)."""
    scaler = report.get("scaler") or {}
    steps = len(scaler.get("steps") or [])
    return bool(steps) and scaler.get("skipped_steps") == steps


def verdict(report: dict) -> str:
    first = report["first_nonfinite"]
    kinds = sorted({f["kind"] for f in report["findings"]})
    script = report.get("script") or {}
    failed = script.get("error_summary") if script.get("exit_code") else None
    watch = report.get("watch")
    if watch and not watch.get("trigger"):
        ran = f"{watch['steps_watched']} watched step(s)"
        if failed:
            return (f"The script failed ({failed}) after {ran}; no trouble before it: every loss was finite and "
                    "the GradScaler never kept skipping, so nothing was traced.")
        return (f"No trouble in {ran}: every loss was finite and the GradScaler never kept skipping, so nothing "
                "was traced (watch mode checks only these; run without --watch for per-layer statistics).")
    if not report.get("modules_ran", True):
        if failed:
            return f"Nothing was traced: the script failed before any module ran ({failed})."
        return "Nothing was traced: no nn.Module ran in the script."
    tail = f" The script then failed ({failed}); the report covers what ran before." if failed else ""
    if first:
        op = f", {first['op']}" if first.get("op") else ""
        rank = f", rank {first['rank']}" if report.get("ranks") and first.get("rank") is not None else ""
        at = f"step {first['step']}{op}{rank}"
        if first["phase"] == "input":
            return (f"NaN/Inf first appeared in the input of `{first['module']}` ({at}): it came with the data, "
                    f"not from a layer.{tail}")
        if first["phase"] == "loss":
            return f"NaN/Inf first appeared in the loss ({at}), computed outside any module.{tail}"
        if first["phase"] == "param":
            names = ", ".join(f"`{p}`" for p in (first.get("params") or [])[:3])
            return f"NaN/Inf first appeared in the gradients of {names} ({at}).{tail}"
        if first["module"] is None:
            return f"NaN/Inf first appeared in backward outside any module ({at}).{tail}"
        return f"NaN/Inf first appeared in `{first['module']}` ({first['phase']}, {at}).{tail}"
    if kinds:
        return f"Numerical risks found ({', '.join(kinds)}) judged against {report['target_dtype']}.{tail}"
    if failed:
        return (f"The script failed ({failed}) after {report['steps']} step(s); no numerical problems in what "
                f"ran before, judged against {report['target_dtype']}.")
    if _all_skipped(report):
        # every skip may be the back-off from init_scale, but no step has gone through yet
        scaler = report["scaler"]
        return (f"Not judged: the GradScaler skipped all {len(scaler['steps'])} optimizer step(s) while its scale "
                f"backed off ({_num(scaler.get('initial_scale'))} → {_num(scaler.get('final_scale'))}), so no step "
                "went through. Run more steps to tell the warm-up from a real overflow.")
    return f"No numerical problems found in {report['steps']} step(s), judged against {report['target_dtype']}."


_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def short_dtype(dtype: str) -> str:
    return ",".join(_DTYPE.get(d, d) for d in dtype.split(",")) if dtype else "-"


def middle(name: str, width: int) -> str:
    """``name`` shortened to ``width`` characters (the full path is in the JSON), so that sibling
    layers stay apart: they differ in the tail and in the layer index (`h.0.attn.c_attn`,
    `h.1.attn.c_attn`), while the head is the same model prefix on every row. Whole dotted
    components are kept from the end (`…h.0.attn.c_attn`); when the last layer index does not fit
    that way it is kept in front of the tail (`…11…lora_A.default`); names with no room for that
    are cut in the middle."""
    if len(name) <= width:
        return name
    if width <= 3:
        return name[:width]
    parts = name.split(".")
    start = _tail_start(parts, width - 1)
    indices = [i for i, p in enumerate(parts) if p.isdigit()]
    missing = [i for i in indices if i < start]
    if start < len(parts) and not missing:
        return "…" + ".".join(parts[start:])
    if missing:
        lead = "…" + ".".join(parts[i] for i in missing) + "…"
        room = width - len(lead)
        rest = parts[missing[-1] + 1:]
        text = ".".join(rest)
        if room >= min(6, len(text)):
            whole = ".".join(rest[_tail_start(rest, room):])
            return lead + (whole if len(whole) * 2 >= room else text[len(text) - room:])
    keep = width - 1
    head = keep // 3
    return name[:head] + "…" + name[len(name) - (keep - head):]


def _tail_start(parts: list[str], room: int) -> int:
    """Index of the first of the most trailing ``parts`` whose dotted join fits in ``room``."""
    start = len(parts)
    while start > 0 and len(".".join(parts[start - 1:])) <= room:
        start -= 1
    return start


def _pct(x: float) -> str:
    if not x:
        return "0"
    v = x * 100
    return f"{v:.3g}%" if v >= 0.1 else "<0.1%"


def _nonfinite(r: dict) -> str:
    nan, inf = r["nonfinite"]["nan"], r["nonfinite"]["pinf"] + r["nonfinite"]["ninf"]
    if not nan and not inf:
        return "0"
    return f"{nan}/{inf}"


def _absmax(r: dict) -> str:
    if r["absmax"] is not None:
        return _num(r["absmax"])
    nf = r["nonfinite"]
    return "nan" if nf["nan"] else "inf" if nf["pinf"] + nf["ninf"] else "-"


def table_rows(report: dict, limit: int = 10) -> list[dict]:
    """The worst layers: the origin first, then by non-finite count, overflow, underflow, headroom.
    Forward rows, and backward rows holding any NaN, ±inf or underflow (so a skipped step's
    inf gradients are never hidden)."""
    rows = [r for r in report["modules"] if r["phase"] == "forward" or sum(r["nonfinite"].values())
            or r["underflow_fraction"]]

    def risk(r):
        nf = sum(r["nonfinite"].values())
        head = r["headroom_bits"] if r["headroom_bits"] is not None else (-1e9 if nf else 1e9)
        return (-nf, -r["overflow_fraction"], -r["underflow_fraction"], head)

    return sorted(rows, key=lambda r: (not r.get("origin"), risk(r)))[:limit]


# (header, justify, minimum width at which the column is shown)
_COLUMNS = (
    ("", "left", 0),
    ("rank", "right", 0),  # only in a merged multi-rank report: the rank holding the value shown
    ("module", "left", 0),
    ("class", "left", 100),
    ("pass", "left", 0),
    ("dtype", "left", 0),
    ("absmax", "right", 0),
    ("min>0", "right", 0),
    ("headroom", "right", 100),
    ("nan/inf", "right", 0),
    ("ovf", "right", 0),
    ("unf", "right", 0),
    ("calls", "right", 120),
)


def _cells(r: dict) -> dict:
    return {
        "": ">" if r.get("origin") else "",
        "rank": str(r["rank"]) if r.get("rank") is not None else "-",
        "module": r["module"],
        "class": r["class"],
        "pass": "fwd" if r["phase"] == "forward" else "bwd",
        "dtype": short_dtype(r["dtype"]),
        "absmax": _absmax(r),
        "min>0": _num(r["min_nonzero"]),
        "headroom": _num(r["headroom_bits"]),
        "nan/inf": _nonfinite(r),
        "ovf": _pct(r["overflow_fraction"]),
        "unf": _pct(r["underflow_fraction"]),
        "calls": str(r["calls"]),
    }


def layer_table(rows: list[dict], width: int, ranks: bool = False) -> list[str]:
    """The table as plain lines that fit ``width``: columns by priority, module names shortened in
    the middle, every number whole; with ``ranks``, the rank holding each row's worst value."""
    cols = [c for c in _COLUMNS if width >= c[2] and (ranks or c[0] != "rank")]
    cells = [_cells(r) for r in rows]
    widths = {h: max([len(h)] + [len(c[h]) for c in cells]) for h, _, _ in cols}
    sep = 2
    if "class" in widths:
        widths["class"] = min(widths["class"], 16)
    fixed = sum(widths[h] for h, _, _ in cols if h != "module") + sep * (len(cols) - 1)
    widths["module"] = max(8, min(widths["module"], width - fixed))

    def line(values: dict) -> str:
        out = []
        for h, justify, _ in cols:
            v = values[h]
            if h in ("module", "class"):
                v = middle(v, widths[h])
            out.append(v.rjust(widths[h]) if justify == "right" else v.ljust(widths[h]))
        return (" " * sep).join(out).rstrip()

    head = line({h: h for h, _, _ in cols})
    return [head] + [line(c) for c in cells]


def _wrapped(console: Console, text: str, indent: str = "", first: str = "", style: str | None = None) -> None:
    width = max(20, console.width)
    lines = textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False) or [first]
    for ln in lines:
        console.print(f"[{style}]{escape(ln)}[/{style}]" if style else escape(ln), highlight=False, soft_wrap=True)


def _rank_line(r: dict) -> str:
    """One rank of a merged report: how its script ended, where it first went non-finite, what
    its GradScaler skipped."""
    if r["status"] == "missing":
        return f"rank {r['rank']}: {r['note']}"
    parts = [f"rank {r['rank']}: {r['steps']} step(s)"]
    if r["status"] != "ok":
        parts.append(f"the script {'raised' if r['status'] == 'raised' else 'failed'}: {r.get('error_summary')}")
    first = r.get("first_nonfinite")
    if first:
        where = f"`{first['module']}` " if first.get("module") else ""
        parts.append(f"first NaN/Inf at step {first['step']} ({where}{first['phase']})")
    if r.get("skipped_steps"):
        shown = ", ".join(map(str, r["skipped_steps"][:8])) + (" …" if len(r["skipped_steps"]) > 8 else "")
        parts.append(f"GradScaler skipped step(s) {shown}")
    return "; ".join(parts)


def compare_advice(layers: list[dict]) -> str | None:
    """The advice for the worst compared layer (containers have none of their own)."""
    return next((r["advice"] for r in layers if r.get("advice") and not r.get("container")), None)


def compare_legend(own: str, carried: str) -> str:
    """What the comparison's columns mean, under the names a report gives them."""
    return (f"{own}: relative L2 error of the output against the layer's float32 re-run on the same inputs; "
            f"{carried}: against the float32 reference of the whole run so far; bits lost: of the format's own, "
            "beyond its rounding")


def _compare(console: Console, report: dict, limit: int = 8) -> None:
    """--compare fp32: the layers that lose the most digits themselves, worst first."""
    cmp = report.get("compare")
    if not cmp:
        return
    rows = [r for r in cmp["layers"] if not r["container"]][:limit]
    console.print()
    console.print(f"[bold]precision against float32[/bold]  ({report['target_dtype']}: {cmp['format_bits']} bits)",
                  highlight=False)
    width = max(40, console.width)
    name_w = max(8, min(28, width - 62))
    head = f"{'module':<{name_w}}  {'class':<12}  {'own err':>8}  {'bits lost':>9}  {'err (carried)':>13}  {'calls':>5}"
    console.print(f"[dim]{escape(head[:width])}[/dim]", highlight=False, soft_wrap=True)
    for r in rows:
        line = (f"{middle(r['module'] or '?', name_w):<{name_w}}  {(r['class'] or '')[:12]:<12}  "
                f"{_num(r['own_rel_err']):>8}  {_num(r['bits_lost']):>9}  {_num(r['rel_err_median']):>13}  "
                f"{r['calls']:>5}")
        style = "bold red" if (r["bits_lost"] or 0) >= LOSSY_BITS else None
        console.print(f"[{style}]{escape(line[:width])}[/{style}]" if style else escape(line[:width]),
                      highlight=False, soft_wrap=True)
    advice = compare_advice(rows)
    if advice:
        _wrapped(console, advice, indent="  ", first="  ")
    _wrapped(console, compare_legend("own err", "err (carried)"), indent="  ", style="dim")


def watch_line(report: dict) -> str | None:
    """What watch mode saw: the bad step, why, and which steps the full trace covers."""
    watch = report.get("watch")
    if not watch or not watch.get("trigger"):
        return None
    t, traced = watch["trigger"], watch.get("traced_steps") or []
    span = f"steps {traced[0]}-{traced[1]} traced" if len(traced) == 2 and traced[1] > traced[0] else \
        f"step {traced[0]} traced" if traced else "nothing traced"
    replay = ", the bad step replayed" if watch.get("replayed") else ""
    return f"watch: step {t['step']}: {t['reason']}; {span}{replay}"


def render_verdict(console: Console, report: dict) -> None:
    bad = bool(report["findings"] or report["first_nonfinite"])
    style = "bold red" if bad else "bold yellow" if _all_skipped(report) else "bold green"
    _wrapped(console, verdict(report), style=style)


def render(console: Console, report: dict, limit: int = 10) -> None:
    render_verdict(console, report)
    ranks = report.get("ranks") or []
    per_rank = " per rank" if ranks else ""
    _wrapped(console, f"target {report['target_dtype']} · dtypes seen: {', '.join(report['dtypes_seen']) or '-'} · "
             + (f"{len(ranks)} ranks · " if ranks else "")
             + f"{report['steps']} step(s) · {report['transfers']} host transfer(s){per_rank}", indent="  ")
    for r in ranks:
        _wrapped(console, _rank_line(r), indent="      ", first="  ")
    line = watch_line(report)
    if line:
        _wrapped(console, line, indent="  ")
        for note in report["watch"].get("replay_notes") or []:
            _wrapped(console, f"note: {note}", indent="  ", first="  ", style="dim")
    origin = report.get("op_origin")
    if origin and origin.get("op"):
        note = f" ({origin['note']})" if origin.get("note") else ""
        _wrapped(console, f"op-level origin: {origin['op']} produced {origin['produced']} in "
                 f"`{origin['module']}`{note}", indent="  ")
    elif origin:
        _wrapped(console, f"op-level replay: {origin.get('note') or 'no origin found'}", indent="  ")
    if report["findings"]:
        console.print()
        for f in report["findings"]:
            where = [f["kind"]]
            if f.get("module"):
                where.append(f["module"])
            where.append(f"{f['phase']}, step {f['step']}")
            if ranks and f.get("rank") is not None:
                others = [r for r in f.get("ranks") or [] if r != f["rank"]]
                where.append(f"rank {f['rank']}" + (f" (also {', '.join(map(str, others))})" if others else "")
                             + (f", after rank {f['follows']['rank']}" if f.get("follows") else ""))
            _wrapped(console, " · ".join(where), indent="    ", first="", style="yellow")
            _wrapped(console, f["message"], indent="  ", first="  ")
    worst = table_rows(report, limit)
    if worst:
        console.print()
        console.print("[bold]worst layers[/bold]" + ("  (> where NaN/Inf first appeared)" if any(
            r.get("origin") for r in worst) else ""), highlight=False)
        lines = layer_table(worst, max(40, console.width), ranks=bool(ranks))
        console.print(f"[dim]{escape(lines[0])}[/dim]", highlight=False, soft_wrap=True)
        for ln, r in zip(lines[1:], worst):
            s = "bold red" if r.get("origin") else ("red" if sum(r["nonfinite"].values()) else None)
            console.print(f"[{s}]{escape(ln)}[/{s}]" if s else escape(ln), highlight=False, soft_wrap=True)
        _wrapped(console, "ovf: values beyond the target's largest finite value; unf: nonzero values below its "
                 "smallest normal; nan/inf: counts; headroom: log2(max / absmax)"
                 + ("; rank: the rank holding the NaN/Inf or the largest |value| (the others' are in the "
                    "JSON)" if ranks else ""), indent="  ", style="dim")
    _compare(console, report)
    if report.get("not_traced"):
        _wrapped(console, f"not traced (ran inside torch.compile): {', '.join(report['not_traced'])}", indent="  ")
    scaler = report.get("scaler")
    if scaler:
        whose = f" (rank {report['first_nonfinite']['rank']})" if ranks and report.get("first_nonfinite") else \
            f" (rank {ranks[0]['rank']})" if ranks else ""
        _wrapped(console, f"GradScaler{whose}: scale {_num(scaler['initial_scale'])} → {_num(scaler['final_scale'])}, "
                 f"{scaler['skipped_steps']} of {len(scaler['steps'])} step(s) skipped", indent="  ")
    for note in [*(report.get("distributed") or {}).get("notes", []), *report.get("notes", [])]:
        _wrapped(console, f"note: {note}", indent="  ", first="  ", style="dim")
