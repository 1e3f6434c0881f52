"""Terminal summary of a trace report: the verdict first, then the findings and worst layers."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def verdict(report: dict) -> str:
    first = report["first_nonfinite"]
    kinds = sorted({f["kind"] for f in report["findings"]})
    script = report.get("script") or {}
    failed = script.get("error_summary") if script.get("exit_code") else None
    if not report.get("modules_ran", True):
        if failed:
            return f"Nothing was traced: the script failed before any module ran ({failed})."
        return "Nothing was traced: no nn.Module ran in the script."
    tail = f" The script then failed ({failed}); the report covers what ran before." if failed else ""
    if first:
        op = f", {first['op']}" if first.get("op") else ""
        at = f"step {first['step']}{op}"
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
    return f"No numerical problems found in {report['steps']} step(s), judged against {report['target_dtype']}."


def render(console: Console, report: dict, limit: int = 10) -> None:
    bad = bool(report["findings"] or report["first_nonfinite"])
    style = "bold red" if bad else "bold green"
    console.print(f"[{style}]{escape(verdict(report))}[/{style}]", highlight=False)
    console.print(f"target {report['target_dtype']} · dtypes seen: {', '.join(report['dtypes_seen']) or '-'} · "
                  f"{report['steps']} step(s) · {report['transfers']} host transfer(s)", highlight=False)
    origin = report.get("op_origin")
    if origin and origin.get("op"):
        note = f" ({origin['note']})" if origin.get("note") else ""
        console.print(f"op-level origin: [bold]{escape(origin['op'])}[/bold] produced {origin['produced']} in "
                      f"`{escape(origin['module'])}`{escape(note)}", highlight=False)
    elif origin:
        console.print(f"op-level replay: {escape(origin.get('note') or 'no origin found')}", highlight=False)
    if report["findings"]:
        console.print()
        for f in report["findings"]:
            where = f" \\[{escape(f['module'])}]" if f.get("module") else ""
            console.print(f"[yellow]{f['kind']}[/yellow]{where} {f['phase']} step {f['step']}: {escape(f['message'])}",
                          highlight=False, soft_wrap=True)
    rows = [r for r in report["modules"] if r["phase"] == "forward" or r["nonfinite"]["nan"] or r["underflow_fraction"]]

    def risk(r):
        nf = sum(r["nonfinite"].values())
        head = r["headroom_bits"] if r["headroom_bits"] is not None else (-1e9 if nf else 1e9)
        return (-nf, -r["overflow_fraction"], -r["underflow_fraction"], head)

    worst = sorted(rows, key=lambda r: (not r.get("origin"), risk(r)))[:limit]  # the origin first
    if worst:
        table = Table(title="worst layers", title_justify="left")
        for col in ("module", "class", "phase", "dtype", "absmax", "min nonzero", "headroom bits",
                    "non-finite", "overflow", "underflow", "calls"):
            table.add_column(col, overflow="fold")
        for r in worst:
            absmax = _num(r["absmax"]) if r["absmax"] is not None else (
                "nan" if r["nonfinite"]["nan"] else "inf" if r["nonfinite"]["pinf"] + r["nonfinite"]["ninf"] else "-")
            table.add_row(escape(r["module"]), escape(r["class"]), r["phase"], r["dtype"], absmax,
                          _num(r["min_nonzero"]), _num(r["headroom_bits"]), str(sum(r["nonfinite"].values())),
                          f"{r['overflow_fraction']:.1%}", f"{r['underflow_fraction']:.1%}", str(r["calls"]))
        console.print(table)
    if report.get("not_traced"):
        console.print(f"not traced (ran inside torch.compile): {escape(', '.join(report['not_traced']))}",
                      highlight=False)
    scaler = report.get("scaler")
    if scaler:
        console.print(f"GradScaler: scale {_num(scaler['initial_scale'])} → {_num(scaler['final_scale'])}, "
                      f"{scaler['skipped_steps']} of {len(scaler['steps'])} step(s) skipped", highlight=False)
