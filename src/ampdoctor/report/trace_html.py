"""A self-contained HTML page (no network) for a trace report, with an SVG range chart."""

from __future__ import annotations

import html
import json
import math

from ampdoctor.trace.formats import BFLOAT16, FLOAT16

_LO, _HI = -140.0, 130.0  # log2 axis of the chart


def _x(v: float, width: float) -> float:
    e = max(_LO, min(_HI, math.log2(v))) if v > 0 else _LO
    return (e - _LO) / (_HI - _LO) * width


def _chart(rows: list[dict], width: int = 720, row_h: int = 16) -> str:
    rows = [r for r in rows if r["phase"] == "forward"]
    label_w = 260
    h = row_h * len(rows) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + label_w + 20}" height="{h}" role="img" '
           f'aria-label="value range of each layer against fp16 and bf16">']
    for fmt, color in ((BFLOAT16, "#dbeafe"), (FLOAT16, "#fde68a")):
        x0, x1 = _x(fmt.smallest_subnormal, width), _x(fmt.max, width)
        out.append(f'<rect x="{label_w + x0:.1f}" y="20" width="{x1 - x0:.1f}" height="{h - 30}" fill="{color}" '
                   f'opacity="0.7"><title>{fmt.name}: {fmt.smallest_subnormal:.3g} .. {fmt.max:.3g}</title></rect>')
        out.append(f'<text x="{label_w + x0 + 2:.1f}" y="14" font-size="10">{fmt.name}</text>')
    for i, r in enumerate(rows):
        y = 24 + i * row_h
        name = html.escape(r["module"])
        out.append(f'<text x="0" y="{y + 10}" font-size="11">{name}</text>')
        lo, hi = r.get("min_nonzero"), r.get("absmax")
        bad = sum(r["nonfinite"].values()) > 0
        if hi is None and not bad:
            continue
        x0 = _x(lo, width) if lo else 0.0
        x1 = _x(hi, width) if hi else width
        color = "#dc2626" if bad else "#2563eb"
        tip = html.escape(f"{r['module']}: {lo} .. {hi}, non-finite {r['nonfinite']}")
        out.append(f'<rect x="{label_w + x0:.1f}" y="{y}" width="{max(2.0, x1 - x0):.1f}" height="{row_h - 4}" '
                   f'fill="{color}"><title>{tip}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def render(report: dict) -> str:
    from ampdoctor.report.trace_text import verdict

    esc = html.escape
    findings = "".join(
        f"<li><b>{esc(f['kind'])}</b> {esc(f.get('module') or '')} ({esc(f['phase'])}, step {f['step']}): "
        f"{esc(f['message'])}</li>" for f in report["findings"]) or "<li>none</li>"
    head = ("<tr>" + "".join(f"<th>{c}</th>" for c in ("module", "class", "phase", "dtype", "absmax", "min nonzero",
                                                        "headroom bits", "non-finite", "overflow", "underflow",
                                                        "calls")) + "</tr>")
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in (
            r["module"], r["class"], r["phase"], r["dtype"], r["absmax"], r["min_nonzero"], r["headroom_bits"],
            sum(r["nonfinite"].values()), f"{r['overflow_fraction']:.2%}", f"{r['underflow_fraction']:.2%}",
            r["calls"])) + "</tr>" for r in report["modules"])
    # JSON inside <script> is raw text: escape what could end the element instead of HTML-escaping
    data = json.dumps(report, default=str).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ampdoctor trace report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#111}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}} .verdict{{font-size:1.3em;font-weight:bold}}
</style></head><body>
<h1>ampdoctor trace report</h1>
<p class="verdict">{esc(verdict(report))}</p>
<p>target {esc(report['target_dtype'])}; dtypes seen: {esc(', '.join(report['dtypes_seen']))};
{report['steps']} step(s); {report['transfers']} host transfer(s)</p>
<h2>Findings</h2><ul>{findings}</ul>
<h2>Value range of each layer (log2 scale) against the fp16 and bf16 ranges</h2>
{_chart(report['modules'])}
<h2>Layers</h2><table>{head}{body}</table>
<script type="application/json" id="report-data">{data}</script>
</body></html>
"""
