"""A self-contained HTML page (no network) for a trace report: the verdict, the findings, and
each layer's value range on a log2 axis, forward and backward side by side, against the float16
and bfloat16 limits; then the layer table. Hand-written SVG keeps the page one small file."""

from __future__ import annotations

import html
import json
import math
import re

from ampdoctor.report.trace_text import _absmax, _num, compare_advice, compare_legend, table_rows, verdict, watch_line
from ampdoctor.trace.formats import BFLOAT16, FLOAT16, FORMATS, LOSSY_BITS

# log2 axes: float16's limits (2^-24 .. 2^16) with room either side, or bfloat16's (2^-133 .. 2^128)
_AXES = {"float16": (-30.0, 20.0, 5), "bfloat16": (-140.0, 135.0, 25)}
_COLORS = {"origin": "#dc2626", "nonfinite": "#f59e0b", "healthy": "#2563eb"}


def _x(v: float, width: float, axis) -> float:
    lo, hi = axis[:2]
    e = max(lo, min(hi, math.log2(v))) if v > 0 else lo
    return (e - lo) / (hi - lo) * width


def _kind(r: dict) -> str:
    if r.get("origin"):
        return "origin"
    return "nonfinite" if sum(r["nonfinite"].values()) else "healthy"


def _panel(rows: list[dict], title: str, width: int, row_h: int, label_w: int, axis) -> str:
    """One panel: a row per layer, its [min nonzero, absmax] range as a bar; NaN/inf as a marker."""
    h = row_h * max(1, len(rows)) + 82
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + label_w + 30}" height="{h}" role="img" '
           f'aria-label="{html.escape(title)}: value range of each layer">',
           f'<text x="0" y="14" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    top, bottom = 52, h - 26
    # the limits of the two formats
    lo, hi, tick = axis
    n = 0
    for fmt, color in ((FLOAT16, "#b45309"), (BFLOAT16, "#1d4ed8")):
        for value, what in ((fmt.max, "max"), (fmt.smallest_normal, "min normal"),
                            (fmt.smallest_subnormal, "min subnormal")):
            if not (2 ** lo <= value <= 2 ** hi):
                continue
            x = label_w + _x(value, width, axis)
            out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{bottom}" stroke="{color}" '
                       f'stroke-dasharray="3,3"><title>{fmt.name} {what}: {value:.3g}</title></line>')
            out.append(f'<text x="{x + 2:.1f}" y="{top - 24 + 9 * (n % 3)}" font-size="9" fill="{color}">'
                       f'{"fp16" if fmt is FLOAT16 else "bf16"} {what}</text>')
            n += 1
    for e in range(int(lo), int(hi) + 1, tick):
        x = label_w + (e - lo) / (hi - lo) * width
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#555"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 15}" font-size="9" text-anchor="middle">2^{e}</text>')
    out.append(f'<line x1="{label_w}" y1="{bottom}" x2="{label_w + width}" y2="{bottom}" stroke="#555"/>')
    for i, r in enumerate(rows):
        y = top + i * row_h
        kind = _kind(r)
        out.append(f'<text x="0" y="{y + 10}" font-size="11">{html.escape(r["module"])}</text>')
        lo, hi = r.get("min_nonzero"), r.get("absmax")
        nf = r["nonfinite"]
        tip = (f"{r['module']} ({r['phase']}, {r['dtype']}): min nonzero {_num(lo)}, absmax {_num(hi)}, "
               f"NaN {nf['nan']}, +inf {nf['pinf']}, -inf {nf['ninf']}")
        if lo and (hi or sum(nf.values())):  # non-finite values: the bar runs to the axis end, then the marker
            x0 = _x(lo, width, axis)
            x1 = _x(hi, width, axis) if hi else width
            out.append(f'<rect x="{label_w + x0:.1f}" y="{y}" width="{max(2.0, x1 - x0):.1f}" height="{row_h - 5}" '
                       f'fill="{_COLORS[kind]}" class="bar {kind}"><title>{html.escape(tip)}</title></rect>')
        if sum(nf.values()):  # a marker past the axis, not a bar that pretends to be huge
            label = "NaN" if nf["nan"] else "inf"
            out.append(f'<text x="{label_w + width + 4}" y="{y + 10}" font-size="10" fill="{_COLORS[kind]}" '
                       f'class="marker {kind}">{label}<title>{html.escape(tip)}</title></text>')
    out.append("</svg>")
    return "".join(out)


def _chart(rows: list[dict], target: str = "float16", width: int = 460, row_h: int = 16) -> str:
    axis = _AXES.get(target, _AXES["float16"])
    label_w = min(260, 7 * max([len(r["module"]) for r in rows] + [8]))
    fwd = [r for r in rows if r["phase"] == "forward"]
    bwd = [r for r in rows if r["phase"] != "forward"]
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{t}</span>' for t, c in (
        ("where NaN/Inf first appeared", _COLORS["origin"]), ("NaN/Inf carried from elsewhere", _COLORS["nonfinite"]),
        ("finite values", _COLORS["healthy"])))
    return (f'<div class="legend">{legend}</div><div class="panels">'
            f'<div>{_panel(fwd, "forward (outputs)", width, row_h, label_w, axis)}</div>'
            f'<div>{_panel(bwd, "backward (gradients)", width, row_h, label_w, axis)}</div></div>'
            + ('<p class="note">bfloat16 shares float32\'s range (2^-133 .. 2^128), beyond this axis.</p>'
               if target == "float16" else ""))


_CODE = re.compile(r"`([^`]+)`")


def _md(text: str) -> str:
    """The report's Markdown-style `code` spans as <code>; everything else escaped."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def _line_chart(series: list[tuple[str, str, list[tuple[int, float | None]]]], title: str, limit=None,
                width: int = 640, height: int = 180) -> str:
    """Lines of log2(value) over steps; a None value (NaN/inf, a skipped step) is a cross at the top."""
    pts = [(s, v) for _, _, xs in series for s, v in xs]
    if not pts:
        return ""
    s_max = max(1, max(s for s, _ in pts))
    vals = [math.log2(v) for _, v in pts if v] + ([math.log2(limit[0])] if limit else [])
    lo, hi = (math.floor(min(vals)) - 1, math.ceil(max(vals)) + 1) if vals else (0, 1)
    left, top, bottom = 48, 24, height - 30

    def X(s):
        return left + s / s_max * (width - left - 10)

    def Y(v):
        return bottom - (math.log2(v) - lo) / max(1e-9, hi - lo) * (bottom - top)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(title)}"><text x="0" y="12" font-size="12" font-weight="bold">'
           f'{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#555"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#555"/>',
           f'<text x="{width - 10}" y="{bottom + 24}" font-size="9" text-anchor="end">step</text>']
    step = max(1, round((hi - lo) / 5))
    for e in range(lo, hi + 1, step):
        y = bottom - (e - lo) / max(1e-9, hi - lo) * (bottom - top)
        out.append(f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="9" text-anchor="end">2^{e}</text>')
    for s in sorted({0, s_max, s_max // 2}):
        out.append(f'<text x="{X(s):.1f}" y="{bottom + 12}" font-size="9" text-anchor="middle">{s}</text>')
    if limit:
        y = Y(limit[0])
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" stroke="#b45309" '
                   f'stroke-dasharray="3,3"/><text x="{width - 12}" y="{y - 3:.1f}" font-size="9" fill="#b45309" '
                   f'text-anchor="end">{html.escape(limit[1])}</text>')
    for name, color, xs in series:
        line = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in xs if v)
        if line:
            out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5">'
                       f'<title>{html.escape(name)}</title></polyline>')
        for s, v in xs:
            if not v:
                out.append(f'<text x="{X(s):.1f}" y="{top + 4}" font-size="10" fill="{color}" text-anchor="middle">'
                           f'×<title>{html.escape(name)}: step {s}</title></text>')
    keys = "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(n)}</span>' for n, c, _ in series)
    out.append("</svg>")
    return f'<div class="legend">{keys}</div>' + "".join(out)


_PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")


def _over_steps(report: dict) -> str:
    """The worst layers' absmax over the steps, against the target's largest value."""
    rows = [r for r in table_rows(report, 5) if r.get("absmax_by_step")]
    if not rows or report["steps"] < 2:
        return ""
    fmt = FORMATS.get(report["target_dtype"])
    series = [(f"{r['module']} ({r['phase']})", _PALETTE[i % len(_PALETTE)],
               [(s, v) for s, v in r["absmax_by_step"]]) for i, r in enumerate(rows)]
    return _line_chart(series, "largest |value| per step of the worst layers (× NaN/inf)",
                       limit=(fmt.max, f"{'fp16' if fmt is FLOAT16 else 'bf16'} max") if fmt else None)


def _scaler(report: dict) -> str:
    s = report.get("scaler")
    if not s:
        return ""
    steps = s.get("steps") or []
    chart = ""
    if len(steps) >= 2:
        pts = [(st["step"], st["scale"]) for st in steps if st.get("scale")]
        skips = [(st["step"], None) for st in steps if st.get("skipped")]
        chart = _line_chart([("loss scale", "#2563eb", pts), ("skipped step", "#dc2626", skips)],
                            "loss scale per step (× skipped step)")
    return (f"<h2>GradScaler</h2><p>scale {_num(s.get('initial_scale'))} → {_num(s.get('final_scale'))}; "
            f"{s.get('skipped_steps', 0)} of {len(steps)} step(s) skipped</p>{chart}")


def _ranks(report: dict) -> str:
    """A merged multi-rank report: one row per rank, and the notes about the gradients shown."""
    ranks = report.get("ranks")
    if not ranks:
        return ""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{esc(r['status'])}</td><td>{esc(str(r.get('steps', '-')))}</td>"
        f"<td>{esc(_first_text(r.get('first_nonfinite')))}</td>"
        f"<td>{esc(', '.join(map(str, r.get('skipped_steps') or [])) or '-')}</td>"
        f"<td>{esc(r.get('error_summary') or r.get('note') or '')}</td></tr>" for r in ranks)
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in (report.get("distributed") or {}).get("notes", []))
    return ("<h2>Ranks</h2><table><tr><th>rank</th><th>status</th><th>steps</th><th>first NaN/Inf</th>"
            f"<th>skipped steps</th><th>error</th></tr>{rows}</table>{notes}")


def _compare(report: dict) -> str:
    """--compare fp32: every compared layer, worst first, containers after the layers; the advice
    for the worst one."""
    cmp = report.get("compare")
    if not cmp:
        return ""
    esc = html.escape
    layers = cmp.get("layers") or []
    rows = "".join(
        f'<tr class="{"origin" if (r.get("bits_lost") or 0) >= LOSSY_BITS else ""}">' + "".join(
            f"<td>{esc(v)}</td>" for v in (
                r["module"] or "?", r.get("class") or "", r.get("phase") or "", _num(r["own_rel_err"]),
                _num(r["bits_lost"]), _num(r["rel_err_median"]), _num(r["rel_err_max"]), str(r["calls"]),
                "container" if r.get("container") else "layer")) + "</tr>"
        for r in layers)
    advice = compare_advice(layers)
    return (f"<h2>Precision against float32 ({esc(report['target_dtype'])}: {cmp.get('format_bits', '?')} bits)</h2>"
            + (f"<p>{_md(advice)}</p>" if advice else "")
            + "<table><tr><th>module</th><th>class</th><th>pass</th><th>own error</th><th>bits lost</th>"
              "<th>error carried (median)</th><th>error carried (max)</th><th>calls</th><th></th></tr>"
            + rows + f'</table><p class="note">{esc(compare_legend("own error", "error carried"))}</p>')


def _first_text(first: dict | None) -> str:
    if not first:
        return "-"
    where = f"{first['module']} " if first.get("module") else ""
    return f"step {first['step']}: {where}({first['phase']})"


def render(report: dict) -> str:
    esc = html.escape
    multi = bool(report.get("ranks"))

    def rank_of(f):
        if not multi or f.get("rank") is None:
            return ""
        after = f", after rank {f['follows']['rank']}" if f.get("follows") else ""
        return f", rank {f['rank']}{after}"

    findings = "".join(
        f"<li><b>{esc(f['kind'])}</b> {('<code>' + esc(f['module']) + '</code>') if f.get('module') else ''} "
        f"({esc(f['phase'])}, step {f['step']}{esc(rank_of(f))}): {_md(f['message'])}</li>"
        for f in report["findings"]) or "<li>none</li>"
    cols = (("rank",) if multi else ()) + ("module", "class", "pass", "dtype", "absmax", "min nonzero",
                                          "headroom bits", "NaN", "inf", "overflow", "underflow", "calls")
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"
    body = "".join(
        f'<tr class="{_kind(r)}">' + "".join(f"<td>{esc(v)}</td>" for v in (
            *((str(r.get("rank", "-")),) if multi else ()),
            r["module"], r["class"], r["phase"], r["dtype"] or "-", _absmax(r), _num(r["min_nonzero"]),
            _num(r["headroom_bits"]), str(r["nonfinite"]["nan"]), str(r["nonfinite"]["pinf"] + r["nonfinite"]["ninf"]),
            f"{r['overflow_fraction']:.2%}", f"{r['underflow_fraction']:.2%}", str(r["calls"]))) + "</tr>"
        for r in report["modules"])
    # JSON inside <script> is raw text: escape what could end the element instead of HTML-escaping
    data = json.dumps(report, default=str).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ampdoctor trace report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#111}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}} .verdict{{font-size:1.3em;font-weight:bold}}
tr.origin td{{background:#fee2e2}} tr.nonfinite td{{background:#fef3c7}} code{{background:#f3f4f6;padding:0 2px}}
.panels{{display:flex;flex-wrap:wrap;gap:1em}} .legend .key{{margin-right:1.2em;font-size:12px}}
.legend i{{display:inline-block;width:10px;height:10px;margin-right:4px}} .note{{font-size:12px;color:#555}}
</style></head><body>
<h1>ampdoctor trace report</h1>
<p class="verdict">{_md(verdict(report))}</p>
<p>target {esc(report['target_dtype'])}; dtypes seen: {esc(', '.join(report['dtypes_seen']) or '-')};
{(str(len(report['ranks'])) + ' ranks; ') if multi else ''}{report['steps']} step(s); {report['transfers']} host transfer(s){' per rank' if multi else ''}</p>
{f'<p>{esc(watch_line(report))}</p>' if watch_line(report) else ''}
{''.join(f'<p class="note">note: {esc(n)}</p>' for n in (report.get('watch') or {}).get('replay_notes') or [])}
{_ranks(report)}
<h2>Findings</h2><ul>{findings}</ul>
<h2>Value range of each layer (log2 scale) against the fp16 and bf16 limits</h2>
{_chart(report['modules'], report['target_dtype'])}
{_over_steps(report)}
{_scaler(report)}
{_compare(report)}
<h2>Layers</h2><table>{head}{body}</table>
{''.join(f'<p class="note">note: {esc(n)}</p>' for n in report.get('notes', []))}
<script type="application/json" id="report-data">{data}</script>
</body></html>
"""
