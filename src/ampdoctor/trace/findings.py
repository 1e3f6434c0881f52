"""Turn what the tracer saw into findings and the report's plain data."""

from __future__ import annotations

import math

from ampdoctor import __version__
from ampdoctor.trace.formats import FORMATS, LOW_PRECISION

UNDERFLOW_MAJORITY = 0.5
KINDS = ("nonfinite", "overflow", "underflow", "scaler")
_PHASES = ("input", "forward", "loss", "backward", "param")


def _num(x: float) -> float | None:
    """JSON-safe number (NaN and inf become None)."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return x


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def target_of(tracer) -> str:
    if tracer.target:
        return tracer.target
    for d in LOW_PRECISION:
        if d in tracer.dtypes_seen:
            return d
    return "float16"


_ANCESTORS: dict[str, tuple[str, ...]] = {}


def _parents(name: str) -> tuple[str, ...]:
    hit = _ANCESTORS.get(name)
    if hit is not None:
        return hit
    parts = name.split(".")
    return tuple(".".join(parts[:i]) for i in range(1, len(parts)))


def _innermost(names: list[str]) -> list[str]:
    """Drop every module that is an ancestor of another one in the list."""
    ancestors = {a for n in names for a in _parents(n)}
    return [n for n in names if n not in ancestors]


# -- the GradScaler ------------------------------------------------------------------------------------
SETTLED_SCALE = 2.0 ** 10  # an initial back-off still skipping below this scale is not a warm-up
SETTLED_SKIPS = 4


def scaler_health(recs, warm: bool = False) -> list[str]:
    """What each recorded step was: "ok", "warmup" (a skip during the initial back-off), "probe"
    (the first skip after the scale grew: the scaler trying a higher scale) or "unexpected".

    The rule (also in the README): skips are expected while the scale settles, that is in the run
    of skips the first steps make, and once after each time the scale grew, but only where a
    float16 gradient could overflow at that scale. Any other skip, a second one without a growth
    in between, a skip in a step with no float16 gradient (float32 and bfloat16 do not overflow
    at any loss scale), and a scale below 1 are unexpected. An initial back-off in which no step
    ever goes through, SETTLED_SKIPS skips or more that take the scale below 1024, was never a
    warm-up: all of its skips are unexpected. ``warm``: the scaler had settled before the first
    recorded step (a trace that watch mode started in the middle of a run), so there is no
    initial back-off."""
    out = []
    initial, grew = not warm, False
    first_run: list[int] = []  # the indexes of the initial back-off's skips
    for i, r in enumerate(recs):
        if not r.skipped:
            initial = False
            out.append("ok")
            if r.new_scale is not None and r.scale is not None and r.new_scale > r.scale:
                grew = True
            continue
        collapsed = r.new_scale is not None and not math.isnan(r.new_scale) and r.new_scale < 1.0
        if collapsed or not r.fp16:
            out.append("unexpected")
        elif initial:
            out.append("warmup")
        elif grew:
            out.append("probe")
            grew = False
        else:
            out.append("unexpected")
        if initial:
            first_run.append(i)
    if first_run:
        last = recs[first_run[-1]]
        settled = "ok" in out  # a step went through: the back-off found a scale that works
        low = last.new_scale is not None and not math.isnan(last.new_scale) and last.new_scale < SETTLED_SCALE
        if not settled and len(first_run) >= SETTLED_SKIPS and low or any(out[i] == "unexpected" for i in first_run):
            for i in first_run:  # the scale kept falling with no step going through: a fault, not a warm-up
                out[i] = "unexpected"
    return out


def _scaler_section(tracer, names, health) -> dict | None:
    recs = tracer.step_records
    if not recs:
        return None
    scales = [r.scale for r in recs if r.scale is not None]
    skipped = [r for r in recs if r.skipped]
    return {
        "steps": [{"step": r.step, "scale": _num(r.scale), "new_scale": _num(r.new_scale), "skipped": r.skipped,
                   "health": h,
                   "first_nonfinite_grad": names.get(r.first_bad_grad) if r.first_bad_grad is not None else None,
                   "nonfinite_params": [tracer.namer.param_name(k) for k in r.bad_params]}
                  for r, h in zip(recs, health)],
        "skipped_steps": len(skipped),
        "warmup_skips": health.count("warmup"),
        "probe_skips": health.count("probe"),
        "unexpected_skips": health.count("unexpected"),
        "initial_scale": _num(scales[0]) if scales else None,
        "final_scale": _num(recs[-1].new_scale),
        "min_scale": _num(min(scales + [recs[-1].new_scale] if recs[-1].new_scale is not None else scales))
        if scales else None,
        "max_scale": _num(max(scales + [recs[-1].new_scale] if recs[-1].new_scale is not None else scales))
        if scales else None,
        **(tracer.scaler_meta or {}),
    }


# -- rows ------------------------------------------------------------------------------------------------
def _merged_aggs(tracer, names: dict[int, str]) -> dict[tuple[str, str], object]:
    """(name, phase) -> aggregate; keys that share a name (a model made twice) are merged."""
    out: dict[tuple[str, str], object] = {}
    for (key, phase), agg in tracer.modules.items():
        name = names.get(key, f"({agg.cls})")
        have = out.get((name, phase))
        if have is None:
            out[(name, phase)] = agg
        else:
            if have is tracer.modules.get((have.key, phase)):  # do not change the tracer's own aggregate
                import copy
                have = out[(name, phase)] = copy.deepcopy(have)
            have.merge(agg)
    return out


def module_rows(aggs: dict, target: str) -> list[dict]:
    fmt = FORMATS[target]
    rows = []
    for (name, phase), agg in aggs.items():
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
            "zero_fraction": c["zero"] / elements if elements else 0.0,
            "headroom_bits": _num(fmt.headroom_bits(agg.absmax)) if agg.elements and not math.isnan(agg.absmax)
            else None,
            "first_nonfinite_step": agg.nonfinite_steps[0] if agg.nonfinite_steps else None,
            "origin": bool(agg.origin_steps),
            "elements": elements,
            # [first step of the bucket, largest |value| (null: NaN/inf seen)], buckets of `series_bucket` steps
            "absmax_by_step": [[s, None if math.isinf(v) else _num(v)] for s, v in sorted(agg.series.items())],
            "series_bucket": agg.bucket,
        })
    return rows


def param_rows(tracer, target: str) -> list[dict]:
    rows = []
    for key, pa in tracer.params.items():
        c = pa.classes[target]
        el = pa.elements or 0.0
        nonzero_finite = c["normal"] + c["subnormal"] + c["flush"] + c["overflow"]
        rows.append({
            "param": tracer.namer.param_name(key),
            "dtype": ",".join(sorted(pa.dtypes)),
            "steps": pa.steps,
            "scaled": pa.scaled,
            "absmax": _num(pa.absmax),
            "nonfinite_steps": len(pa.nonfinite_steps),
            "first_nonfinite_step": pa.nonfinite_steps[0] if pa.nonfinite_steps else None,
            "underflow_fraction": (c["subnormal"] + c["flush"]) / nonzero_finite if nonzero_finite else 0.0,
            "zero_fraction": c["zero"] / el if el else 0.0,
        })
    rows.sort(key=param_order)
    return rows


def param_order(row: dict) -> tuple:
    """Parameter rows in the order they went non-finite, then by name (the finite ones last)."""
    return row["first_nonfinite_step"] is None, row["first_nonfinite_step"] or 0, row["param"]


# -- origins -----------------------------------------------------------------------------------------------
def counted_origins(tracer, health_by_step: dict[int, str]) -> list:
    """The origins that count: a backward or parameter-gradient origin in a step the GradScaler
    skipped as expected (it was still settling, or probing a higher scale) is loss scaling at work.
    In an initial back-off that never settled, the early skips also hold overflows that a lower
    scale cures; the origin that is still there at its last skip is the fault."""
    recs = tracer.step_records
    failed = []
    for r in recs:
        if not r.skipped:
            break
        if health_by_step.get(r.step) == "unexpected":
            failed.append(r.step)
    keep = None
    if failed:
        last = [o for o in tracer.origins if o.step == failed[-1] and o.phase in ("backward", "param")]
        if last:
            keep = {(last[0].phase, last[0].key)}
    out = []
    for o in tracer.origins:
        if o.phase in ("backward", "param") and health_by_step.get(o.step) in ("warmup", "probe"):
            continue
        if keep is not None and o.step in failed and o.phase in ("backward", "param") \
                and (o.phase, o.key) not in keep:
            continue
        out.append(o)
    out.sort(key=lambda o: (o.step, o.seq, _PHASES.index(o.phase)))
    return out


def _origin_findings(tracer, origins, names, aggs) -> list[dict]:
    if not origins:
        return []
    step = origins[0].step
    first = [o for o in origins if o.step == step]
    phase = first[0].phase
    out: list[dict] = []
    ops_hint = "" if tracer.ops else " Run with --ops to name the operation."
    compiled_names = {names.get(k) for k in tracer.compiled_in}

    def compiled(key) -> bool:
        return names.get(key) in compiled_names
    if phase == "forward":
        fwd = [o for o in first if o.phase == "forward"]
        keep = set(_innermost([names.get(o.key, "?") for o in fwd]))
        for o in fwd:
            name = names.get(o.key, "?")
            if name not in keep:
                continue
            keep.discard(name)
            agg = aggs.get((name, "forward"))
            cls = agg.cls if agg is not None else tracer.namer.mods[o.key].cls
            op = o.node or {}
            at = f" ({op['op']} produced {op.get('produced') or 'it'} first)" if op.get("op") else ""
            note = f" ({op['note']})" if op.get("note") and op.get("op") else ""
            if o.stored:
                held = ", ".join(f"`{n}`" for n in o.stored[:4])
                out.append({"kind": "nonfinite", "module": name, "phase": "forward", "step": step, "op": None,
                            "message": f"`{name}` ({cls}) produced {'NaN' if o.produced == 'nan' else 'inf'} from "
                                       f"finite inputs{at} (step {step}) because its own {held} already held "
                                       "NaN/Inf: the values are stored in the weights, not made by this call. "
                                       "Look at what wrote them: an earlier update (an optimizer step on "
                                       "non-finite gradients), a checkpoint, or an in-place initialisation."})
            elif o.cast_from is not None and not compiled(o.key):
                fmt = FORMATS[o.dtype]
                what = "NaN" if o.produced == "nan" else "inf"
                out.append({"kind": "overflow", "module": name, "phase": "forward", "step": step,
                            "op": op.get("op"), "input_absmax": o.cast_from,
                            "message": f"`{name}` ({cls}) produced {what}{at} (step {step}) from float32 inputs "
                                       f"that hold values up to {_fmt(o.cast_from)}, beyond {fmt.name}'s largest "
                                       f"finite value ({_fmt(fmt.max)}): their cast to {fmt.name} (autocast's, or one in "
                                       "the layer's own code) made them inf. Scale or normalise the inputs before "
                                       "this layer (check the batch), or keep the layer in float32 "
                                       "(autocast(enabled=False) and .float() inputs)."})
            elif o.kind == "overflow" and not compiled(o.key):
                fmt = FORMATS[o.dtype] if o.dtype in FORMATS else FORMATS["float16"]
                out.append({"kind": "overflow", "module": name, "phase": "forward", "step": step,
                            "op": op.get("op"),
                            "message": f"`{name}` ({cls}) overflowed {fmt.name} from finite inputs{at} (step {step}): "
                                       f"values beyond {_fmt(fmt.max)} became inf.{note} Keep this layer in float32 "
                                       "(autocast(enabled=False) and .float() inputs), scale its inputs down, "
                                       "or use bfloat16."})
            elif compiled(o.key):
                what = "NaN" if o.produced == "nan" else "inf"
                out.append({"kind": "nonfinite", "module": name, "phase": "forward", "step": step,
                            "op": op.get("op"),
                            "message": f"`{name}` ({cls}) produced {what} from finite inputs{at} (step {step}). Its "
                                       "forward ran inside torch.compile, so its submodules were not traced: the "
                                       "origin is somewhere in its compiled code. Trace without torch.compile to "
                                       "name the layer."})
            else:
                what = "NaN" if o.produced == "nan" else "inf"
                out.append({"kind": "nonfinite", "module": name, "phase": "forward", "step": step,
                            "op": op.get("op"),
                            "message": f"`{name}` ({cls}) produced {what} from finite inputs{at} (step {step}); "
                                       f"everything after it only propagated the values.{note} Every input it "
                                       "was given and every submodule output was finite, so its own forward code "
                                       "is the origin." + ("" if op.get("op") else ops_hint)})
    elif phase == "input":
        o = first[0]
        name = names.get(o.key, "?")
        out.append({"kind": "nonfinite", "module": name, "phase": "input", "step": step,
                    "message": f"`{name}` was called with NaN/Inf in its inputs (step {step}), and no module had "
                               "produced them: they came in with the data, or from code outside any module. "
                               "Check the batch (torch.isfinite(x).all()) and the code that prepares it."})
    elif phase == "loss":
        o = first[0]
        what = "NaN" if o.produced == "nan" else "inf"
        low = o.dtype in LOW_PRECISION
        advice = (f" The loss is {o.dtype}: compute it in float32 (call .float() on the logits before the loss)."
                  if low else " This is not a mixed-precision overflow: look for a log of 0, a division by 0 or a "
                              "sqrt of a negative number in the loss code.")
        out.append({"kind": "nonfinite", "module": None, "phase": "loss", "step": step,
                    "message": f"The loss was {what} before backward (step {step}) while every module output was "
                               f"finite: it was computed outside any module, in the loss code.{advice}"})
    elif phase == "backward":
        o = first[0]
        node = o.node or {}
        what = "NaN" if (node.get("produced") or o.produced) == "nan" else "NaN/inf"
        if o.via == "autograd.grad":
            fp16 = o.dtype in LOW_PRECISION
            out.append({"kind": "nonfinite", "module": None, "phase": "backward", "step": step,
                        "message": f"The gradients that torch.autograd.grad(...) returned were {what} (step {step}): "
                                   "a gradient penalty or double backward overflowed, and the loss built on "
                                   "them followed." + (
                                       f" They are {o.dtype}: a loss scale applied to its outputs "
                                       "(scaler.scale(out)) must fit in that range, so expect the GradScaler to "
                                       "skip the first steps while it backs off; divide the gradients by "
                                       "scaler.get_scale() before building the penalty."
                                       if fp16 else " Look for a sqrt or norm of 0, or a division by 0, in "
                                                    "what is differentiated.")})
        elif o.key is None:
            out.append({"kind": "nonfinite", "module": None, "phase": "backward", "step": step,
                        "message": f"Gradients became {what} outside any module in backward (step {step}): "
                                   "between the loss and the model's outputs, or in code between modules, while "
                                   "the loss itself was finite. Look at the backward of the loss code (a "
                                   "log, sqrt or division near 0)."})
        else:
            name = names.get(o.key, "?")
            also = [names.get(k, "?") for k in o.also]
            where = ""
            if node.get("node"):
                where = f" The autograd node was {node['node']}" + (
                    f", created at {node['line']}" if node.get("line") else "") + (
                    f" (named when its backward failed again, at step {node['seen_at']})."
                    if node.get("seen_at") is not None else ".")
            elif tracer.ops:
                note = node.get("note")
                where = " The replay could not name the autograd node" + (f": {note}." if note else ".")
            else:
                where = " Run with --ops to name the autograd node."
            cand = node.get("candidate")
            if cand is not None:  # the replay told the look-alikes apart
                name = names.get(tracer.namer.canonical(cand.key), name)
                also = []
            amb = (f" {_list(also)} read the same input and cannot be told apart from it without --ops."
                   if also else "")
            out.append({"kind": "nonfinite", "module": name, "phase": "backward", "step": step,
                        "node": node.get("node"), "line": node.get("line"),
                        "message": f"`{name}`'s backward turned finite gradients into {what} (step {step}): the "
                                   "gradient flowing into its outputs was finite, the one it sent to its inputs "
                                   f"was not.{where}{amb} Look for sqrt, log, pow or a division near 0, or an "
                                   "overflow, in its backward; with float16 keep this module in float32."})
    else:
        o = first[0]
        ps = [tracer.namer.param_name(k) for k in o.params]
        if o.via == "double-backward":
            message = (f"The gradients of {_list(ps)} were non-finite (step {step}). This step differentiated "
                       "a gradient (torch.autograd.grad(..., create_graph=True)): part of these gradients came "
                       "through the graph of that gradient penalty, which module hooks do not see, and every "
                       "gradient between modules was finite, so the NaN/inf most likely arose there, e.g. the "
                       "backward of a norm or sqrt at 0 (add a small eps inside the norm). With float16, a "
                       "GradScaler skips such steps; without one, these parameters were updated with NaN/inf.")
        else:
            message = (f"The gradients of {_list(ps)} were non-finite (step {step}) while every gradient "
                       "flowing between modules was finite: the product that forms a weight's gradient "
                       "(input x output gradient, summed over the batch) overflowed, or something wrote "
                       "NaN/inf into .grad. With float16, a GradScaler skips such steps; without one, "
                       "these parameters were updated with NaN/inf.")
        out.append({"kind": "nonfinite", "module": None, "phase": "param", "step": step, "params": ps,
                    "message": message})
    for f in out:
        f["origin"] = True
    return out


def _findings(tracer, target: str, rows: list[dict], aggs: dict, names: dict, health: list[str],
              origins: list) -> list[dict]:
    out = _origin_findings(tracer, origins, names, aggs)
    fmt = FORMATS[target]

    exceed = [name for (name, phase), a in aggs.items() if a.exceed_steps and phase == "forward"
              and not (a.dtypes & set(LOW_PRECISION) and target in a.dtypes)]
    for name in _innermost(exceed):
        agg = aggs[(name, "forward")]
        if target == "float16" and agg.classes["float16"]["overflow"] > 0:
            out.append({"kind": "overflow", "module": name, "phase": "forward", "step": agg.exceed_steps[0],
                        "message": f"`{name}` ({agg.cls}) outputs values up to {_fmt(agg.absmax)}, beyond float16's "
                                   f"{_fmt(fmt.max)}: it would overflow to inf under float16. Use bfloat16, keep "
                                   "this layer in float32, or normalise before it."})

    bwd = [r for r in rows if r["phase"] == "backward"]
    under = [r for r in bwd if r["underflow_fraction"] > UNDERFLOW_MAJORITY]
    keep = _innermost([r["module"] for r in under])
    under = sorted((r for r in under if r["module"] in keep), key=lambda r: -r["underflow_fraction"])
    if under:
        worst = under[0]
        others = [r["module"] for r in under[1:]]
        more = f" (and {len(others)} more: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})" if others else ""
        scales = [r.scale for r in tracer.step_records if r.scale is not None]
        if scales:  # a GradScaler is in use: the values measured are already scaled
            advice = (f" even at the GradScaler's scale ({_fmt(min(scales))} to {_fmt(max(scales))}): they lose "
                      "precision or flush to zero. The scaler raises its scale after growth_interval steps without "
                      "an overflow; if this persists, start from a higher init_scale, or train in bfloat16.")
        else:
            advice = (": they lose precision or flush to zero. Scale the loss with torch.amp.GradScaler, or train "
                      "in bfloat16.")
        out.append({"kind": "underflow", "module": worst["module"], "phase": "backward", "step": 0,
                    "modules": [r["module"] for r in under],
                    "message": f"{worst['underflow_fraction']:.0%} of the nonzero gradient values at "
                               f"`{worst['module']}`{more} are below {target}'s normal range "
                               f"({_fmt(fmt.smallest_normal)}){advice}"})
    if tracer.loss.nonzero:
        zero = [r for r in bwd if r["absmax"] == 0 and not sum(r["nonfinite"].values())
                and set(r["dtype"].split(",")) <= set(LOW_PRECISION) and r["dtype"]]
        zkeep = _innermost([r["module"] for r in zero])
        zero = [r["module"] for r in zero if r["module"] in zkeep]
        if zero:
            dt = next(r["dtype"] for r in bwd if r["module"] == zero[0])
            out.append({"kind": "underflow", "module": zero[0], "phase": "backward", "step": 0, "modules": zero,
                        "message": f"Every gradient value at {_list(zero)} is zero in {dt} while the loss is "
                                   "nonzero: the gradients flushed to zero. Scale the loss with "
                                   "torch.amp.GradScaler, or train in bfloat16."})
    low_params = [r for r in param_rows(tracer, target) if set(r["dtype"].split(",")) <= set(LOW_PRECISION)
                  and r["dtype"] and not r["scaled"] and r["nonfinite_steps"] == 0
                  and (r["underflow_fraction"] > UNDERFLOW_MAJORITY or (r["absmax"] == 0 and tracer.loss.nonzero))]
    act = next((f for f in out if f["kind"] == "underflow"), None)
    if low_params and act is not None:  # one cause: say it once
        ps = [r["param"] for r in low_params]
        act["params"] = ps
        act["message"] = act["message"].replace(" Scale the loss", f" So are the {low_params[0]['dtype']} "
                                                                     f"gradients of {_list(ps, 3)}. Scale the loss", 1)
    elif low_params:
        ps = [r["param"] for r in low_params]
        out.append({"kind": "underflow", "module": None, "phase": "param", "step": 0, "params": ps,
                    "message": f"The {low_params[0]['dtype']} gradients of {_list(ps)} are mostly below "
                               f"{target}'s normal range or zero: the updates are lost. Keep float32 master "
                               "weights (autocast with float32 parameters) and scale the loss with "
                               "torch.amp.GradScaler."})

    recs = tracer.step_records
    if recs:
        meta = tracer.scaler_meta or {}
        bad = [r for r, h in zip(recs, health) if h == "unexpected"]
        skipped = [r for r in recs if r.skipped]
        if bad:
            first = bad[0]
            if first.first_bad_grad is not None:
                who = f" (first non-finite gradient: `{names.get(first.first_bad_grad, '?')}`)"
            elif first.bad_params and not first.grads_nonfinite:
                who = (f" (every activation gradient was finite; the parameters with non-finite gradients: "
                       f"{_list([tracer.namer.param_name(k) for k in first.bad_params])})")
            else:
                who = ""
            out.append({"kind": "scaler", "module": names.get(first.first_bad_grad), "phase": "backward",
                        "step": first.step,
                        "message": f"GradScaler skipped {len(skipped)} of {len(recs)} optimizer steps because of "
                                   f"inf/NaN gradients, {len(bad)} of them after its scale had settled, the first at "
                                   f"step {first.step}{who}. A skip while the scale settles at the start, or right "
                                   "after it grows, is normal; these are not."})
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
    # a stable sort: within a step, phase and kind, findings keep the order things happened in
    out.sort(key=lambda f: (f["step"] if f["step"] is not None else 1 << 30, f["kind"] == "scaler",
                            _PHASES.index(f["phase"]) if f["phase"] in _PHASES else 9,
                            KINDS.index(f["kind"])))
    return out


def _first(tracer, origins, names, findings) -> dict | None:
    if not origins:
        return None
    o = origins[0]
    name = names.get(o.key) if o.key is not None else None
    node = o.node or {}
    out = {"module": name, "phase": o.phase, "step": o.step, "op": node.get("op") or node.get("node")}
    if o.phase == "backward":
        cand = node.get("candidate")
        if cand is not None:
            out["module"] = names.get(tracer.namer.canonical(cand.key), name)
        out["line"] = node.get("line")
    if o.phase == "param":
        out["params"] = [tracer.namer.param_name(k) for k in o.params]
    return out


def build_report(tracer) -> dict:
    tracer.settle()
    target = target_of(tracer)
    names = tracer.namer.names()
    _ANCESTORS.clear()
    _ANCESTORS.update(tracer.namer.ancestors(names))
    aggs = _merged_aggs(tracer, names)
    rows = module_rows(aggs, target)
    health = scaler_health(tracer.step_records, getattr(tracer, "scaler_warm", False))
    by_step = {r.step: h for r, h in zip(tracer.step_records, health)}
    origins = counted_origins(tracer, by_step)
    findings = _findings(tracer, target, rows, aggs, names, health, origins)
    blamed = {(f["module"], f["phase"]) for f in findings if f.get("origin")}
    for r in rows:  # an origin is what the findings name; later ones only follow from it
        r["origin"] = (r["module"], r["phase"]) in blamed
    op_origin = None
    fwd = next((o for o in tracer.origins if o.phase == "forward" and o.node), None)
    if fwd is not None:
        op_origin = {"module": names.get(fwd.key), "class": tracer.namer.mods[fwd.key].cls, "step": fwd.step,
                     **{k: fwd.node.get(k) for k in ("op", "produced", "note")}}
    loss = tracer.loss
    params = param_rows(tracer, target)
    notes = list(tracer.notes.values())
    if any(p["param"].rsplit(".", 1)[-1] == "_flat_param" for p in params):
        notes.append("FSDP flattened this model's parameters (use_orig_params=False): parameter gradients are "
                     "reported per flattened parameter (`_flat_param`), not by their original names; wrap the "
                     "model with use_orig_params=True to see each parameter.")
    compare = None
    if getattr(tracer, "_comparer", None) is not None:
        compare = tracer._comparer.section(names, tracer.namer.canonical, tracer.namer.mods, target)
    rep = {
        "version": __version__,
        "target_dtype": target,
        "dtypes_seen": sorted(tracer.dtypes_seen),
        "steps": tracer.steps,
        "optimizer_steps": tracer.optimizer_steps,
        "transfers": tracer.transfers,
        "modules_ran": tracer.modules_ran,
        "findings": findings,
        "first_nonfinite": _first(tracer, origins, names, findings),
        "op_origin": op_origin,
        "modules": rows,
        "params": params,
        "loss": {"steps": loss.steps, "dtype": ",".join(sorted(loss.dtypes)), "absmax": _num(loss.absmax),
                 "nonfinite_steps": loss.nonfinite_steps[:32]} if loss.steps else None,
        "scaler": _scaler_section(tracer, names, health),
        "not_traced": sorted(tracer.not_traced),
        "skipped_tensors": dict(sorted(tracer.skipped.items())),
        "notes": notes,
    }
    if compare is not None:
        rep["compare"] = compare
    return rep
