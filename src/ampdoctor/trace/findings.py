"""Turn what the tracer saw into findings and the report's plain data."""

from __future__ import annotations

import math

from ampdoctor import __version__
from ampdoctor.trace.formats import FORMATS, LOW_PRECISION

UNDERFLOW_MAJORITY = 0.5
KINDS = ("nonfinite", "overflow", "underflow", "scaler")


def _num(x: float) -> float | None:
    """JSON-safe number (NaN and inf become None / strings are avoided)."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return x


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def target_of(tracer) -> str:
    if tracer.target:
        return tracer.target
    for d in LOW_PRECISION:
        if d in tracer.dtypes_seen:
            return d
    return "float16"


def _innermost(names: list[str], parents: dict[str, tuple[str, ...]]) -> list[str]:
    """Drop every module that is an ancestor of another one in the list."""
    ancestors = {a for n in names for a in parents.get(n, ())}
    return [n for n in names if n not in ancestors]


def module_rows(tracer, target: str) -> list[dict]:
    fmt = FORMATS[target]
    rows = []
    for (name, phase), agg in tracer.modules.items():
        c = agg.classes[target]
        elements = agg.elements or 0.0
        nonzero_finite = c["normal"] + c["subnormal"] + c["flush"] + c["overflow"]
        rows.append({
            "module": name,
            "class": agg.cls,
            "phase": phase,
            "dtype": ",".join(sorted(agg.dtypes)),
            "calls": agg.calls,
            "absmax": _num(agg.absmax) if agg.elements else None,
            "min_nonzero": _num(agg.min_nonzero),
            "nonfinite": {"nan": round(c["nan"]), "pinf": round(c["pinf"]), "ninf": round(c["ninf"])},
            "overflow_fraction": (c["overflow"] + c["pinf"] + c["ninf"]) / elements if elements else 0.0,
            "underflow_fraction": (c["subnormal"] + c["flush"]) / nonzero_finite if nonzero_finite else 0.0,
            "headroom_bits": _num(fmt.headroom_bits(agg.absmax)) if agg.elements and not math.isnan(agg.absmax) else None,
            "first_nonfinite_step": agg.nonfinite_steps[0] if agg.nonfinite_steps else None,
            "elements": elements,
        })
    return rows


def _scaler_section(tracer) -> dict | None:
    recs = tracer.step_records
    if not recs:
        return None
    scales = [r.scale for r in recs if r.scale is not None]
    skipped = [r for r in recs if r.skipped]
    return {
        "steps": [{"step": r.step, "scale": _num(r.scale), "new_scale": _num(r.new_scale), "skipped": r.skipped,
                   "first_nonfinite_grad": r.first_bad_grad} for r in recs],
        "skipped_steps": len(skipped),
        "initial_scale": _num(scales[0]) if scales else None,
        "final_scale": _num(recs[-1].new_scale),
        "min_scale": _num(min(scales)) if scales else None,
        "max_scale": _num(max(scales)) if scales else None,
        **(tracer.scaler_meta or {}),
    }


def _findings(tracer, target: str, rows: list[dict]) -> list[dict]:
    out: list[dict] = []
    fmt = FORMATS[target]
    mods = tracer.modules
    parents = tracer.parents

    # origins in later steps are nearly always consequences (NaN weights after a bad update)
    first_fwd = min((a.origin_steps[0] for k, a in mods.items() if a.origin_steps and k[1] == "forward"), default=None)
    origins = [k for k, a in mods.items() if a.origin_steps and k[1] == "forward" and a.origin_steps[0] == first_fwd]
    for name in _innermost([k[0] for k in origins], parents):
        agg = mods[(name, "forward")]
        step = agg.origin_steps[0]
        if agg.overflow_steps:
            out.append({"kind": "overflow", "module": name, "phase": "forward", "step": agg.overflow_steps[0],
                        "message": f"`{name}` ({agg.cls}) overflowed {sorted(agg.dtypes & set(LOW_PRECISION))[0]} "
                                   f"from finite inputs (step {agg.overflow_steps[0]}): values beyond "
                                   f"{_fmt(FORMATS[sorted(agg.dtypes & set(LOW_PRECISION))[0]].max)} became inf. "
                                   "Keep this layer in float32 (autocast(enabled=False) and .float() inputs), scale "
                                   "its inputs down, or use bfloat16."})
        else:
            out.append({"kind": "nonfinite", "module": name, "phase": "forward", "step": step,
                        "message": f"`{name}` ({agg.cls}) produced NaN/Inf from finite inputs first (step {step}); "
                                   "everything after it only propagated the values. "
                                   + ("Its children were clean, so its own forward code is the origin. "
                                      if not any(n in origins and name in parents.get(n[0], ()) for n in origins) else "")
                                   + "Run with --ops to name the operation."})
    # a gradient overflow the GradScaler skipped is its normal business: the scaler finding covers it
    skipped_steps = {r.step for r in tracer.step_records if r.skipped}
    bwd = [(a.origin_steps[0], k[0]) for k, a in mods.items() if a.origin_steps and k[1] == "backward"
           and a.origin_steps[0] not in skipped_steps and (first_fwd is None or a.origin_steps[0] < first_fwd)]
    for _, name in sorted(bwd)[:1]:
        agg = mods[(name, "backward")]
        out.append({"kind": "nonfinite", "module": name, "phase": "backward", "step": agg.origin_steps[0],
                    "message": f"The gradient of `{name}`'s output was the first to become non-finite in backward "
                               f"(step {agg.origin_steps[0]}). With fp16, use a GradScaler; check the loss for "
                               "overflow and ops like log/sqrt/div near zero in this module's backward."})

    exceed = [k[0] for k, a in mods.items() if a.exceed_steps and k[1] == "forward"
              and not (a.dtypes & set(LOW_PRECISION) and target in a.dtypes)]
    for name in _innermost(exceed, parents):
        agg = mods[(name, "forward")]
        if target == "float16" and agg.classes["float16"]["overflow"] > 0:
            out.append({"kind": "overflow", "module": name, "phase": "forward", "step": agg.exceed_steps[0],
                        "message": f"`{name}` ({agg.cls}) outputs values up to {_fmt(agg.absmax)}, beyond float16's "
                                   f"{_fmt(fmt.max)}: it would overflow to inf under float16. Use bfloat16, keep "
                                   "this layer in float32, or normalise before it."})

    under = [r for r in rows if r["phase"] == "backward" and r["underflow_fraction"] > UNDERFLOW_MAJORITY]
    keep = _innermost([r["module"] for r in under], parents)
    under = sorted((r for r in under if r["module"] in keep), key=lambda r: -r["underflow_fraction"])
    if under:
        worst = under[0]
        others = [r["module"] for r in under[1:]]
        more = f" (and {len(others)} more: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})" if others else ""
        out.append({"kind": "underflow", "module": worst["module"], "phase": "backward", "step": 0,
                    "modules": [r["module"] for r in under],
                    "message": f"{worst['underflow_fraction']:.0%} of the nonzero gradient values at "
                               f"`{worst['module']}`{more} are below {target}'s normal range "
                               f"({_fmt(fmt.smallest_normal)}): they lose precision or flush to zero. Scale the loss "
                               "with torch.amp.GradScaler, or train in bfloat16."})

    recs = tracer.step_records
    if recs:
        skipped = [r for r in recs if r.skipped]
        meta = tracer.scaler_meta or {}
        if skipped:
            first = skipped[0]
            who = f" (first non-finite gradient: `{first.first_bad_grad}`)" if first.first_bad_grad else ""
            out.append({"kind": "scaler", "module": first.first_bad_grad, "phase": "backward", "step": first.step,
                        "message": f"GradScaler skipped {len(skipped)} of {len(recs)} optimizer steps because of "
                                   f"inf/NaN gradients{who}. A few at the start are normal; many mean the model "
                                   "overflows fp16 at any scale."})
        final = recs[-1].new_scale
        if final is not None and not math.isnan(final) and final < 1.0:
            out.append({"kind": "scaler", "module": None, "phase": "backward", "step": recs[-1].step,
                        "message": f"The loss scale collapsed to {_fmt(final)}: gradients are inf/NaN even unscaled. "
                                   "Look for the first non-finite layer; loss scaling cannot fix a forward overflow."})
        interval = meta.get("growth_interval")
        scales = [r.new_scale for r in recs if r.new_scale is not None]
        if interval and len(recs) >= 2 * interval and scales and max(scales) <= (recs[0].scale or 0):
            out.append({"kind": "scaler", "module": None, "phase": "backward", "step": recs[-1].step,
                        "message": f"The loss scale never grew in {len(recs)} steps (growth_interval={interval}): "
                                   "steps keep being skipped before it can grow."})
    out.sort(key=lambda f: (f["step"] if f["step"] is not None else 1 << 30, f["phase"] != "forward",
                            KINDS.index(f["kind"]), f["module"] or ""))
    return out


def build_report(tracer) -> dict:
    target = target_of(tracer)
    rows = module_rows(tracer, target)
    findings = _findings(tracer, target, rows)
    first = dict(tracer.first_nonfinite) if tracer.first_nonfinite else None
    if first is not None:
        first.pop("class", None)
        if tracer.op_origin and tracer.op_origin.get("module") == first["module"] and not first.get("op"):
            first["op"] = tracer.op_origin["op"]
    return {
        "version": __version__,
        "target_dtype": target,
        "dtypes_seen": sorted(tracer.dtypes_seen),
        "steps": tracer.steps,
        "transfers": tracer.transfers,
        "findings": findings,
        "first_nonfinite": first,
        "op_origin": tracer.op_origin,
        "modules": rows,
        "scaler": _scaler_section(tracer),
        "not_traced": sorted(tracer.not_traced),
    }
