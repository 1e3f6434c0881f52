"""Backward passes: what a backward call differentiates, and whether running it inside an
autocast region can change the gradients.

A backward op is dispatched through autocast like any op, but when the whole graph it walks was
recorded in the same autocast state (the forward ran in the same region), the recast is a no-op:
the backward formulas call the lower-precision ops on tensors autocast already lowered, and the
float32-listed forward ops have backward kernels that autocast does not list. Gradients change
only where the graph holds parts recorded in another state:

- the differentiated value was computed before the region (outside autocast, or in another one);
- the region holds an ``autocast(enabled=False)`` block, written there or opened by a function of
  the file it calls (float32 forward math whose backward ops are now lowered);
- the region calls a custom ``autograd.Function`` of the file whose ``forward`` has
  ``custom_fwd`` and whose ``backward`` has no ``custom_bwd`` (its backward math is lowered
  although its forward was not).

Facts from other files (a model whose ``forward`` disables autocast) are not seen.
"""

from __future__ import annotations

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.rule import Context
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.autocast import Region, autocast_call

AUTOGRAD_CALLS = {"torch.autograd.grad": (0, "outputs"), "torch.autograd.backward": (0, "tensors")}
FUNCTION_BASES = {"torch.autograd.Function", "torch.autograd.function.Function"}
_CUSTOM_BWD = {"torch.amp.custom_bwd", "torch.cuda.amp.custom_bwd", "torch.amp.autocast_mode.custom_bwd"}
_CUSTOM_FWD = {"torch.amp.custom_fwd", "torch.cuda.amp.custom_fwd", "torch.amp.autocast_mode.custom_fwd"}


def is_backward_call(names: Names, call: cst.Call) -> bool:
    """``x.backward()``, ``torch.autograd.grad(...)`` or ``torch.autograd.backward(...)``."""
    return names.qualified(call.func) in AUTOGRAD_CALLS or h.method_call(call, "backward") is not None


def differentiated(names: Names, call: cst.Call) -> cst.BaseExpression | None:
    """The value ``call`` differentiates: the receiver of ``x.backward()`` (``loss`` of
    ``scaler.scale(loss).backward()``), the ``outputs``/``tensors`` of ``torch.autograd.grad`` /
    ``torch.autograd.backward``."""
    q = names.qualified(call.func)
    if q in AUTOGRAD_CALLS:
        value = h.arg(call, *AUTOGRAD_CALLS[q])
    elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "backward":
        value = call.func.value
    else:
        return None
    if isinstance(value, cst.Call):
        mc = h.method_call(value, "scale")
        if mc is not None and voc.is_scaler(names, mc[0]) and value.args:
            value = value.args[0].value
    return value


# methods that reduce or cast a value without computing a forward result
_TRIVIAL = frozenset(("sum", "mean", "float", "double", "to", "type", "squeeze", "view", "reshape",
                      "contiguous", "clone", "__getitem__"))


def _reads(expr: cst.BaseExpression) -> tuple[set[str], bool]:
    """The dotted names ``expr`` reads and whether it computes a forward result (``model(x).sum()``
    does; ``loss.mean()`` and ``a + b`` do not)."""
    from ampdoctor.lint.semantic.values import expr_names

    computes = any(isinstance(n, cst.Call) and not (isinstance(n.func, cst.Attribute) and n.func.attr.value in _TRIVIAL)
                   for n in (expr, *h.walk(expr)))
    return expr_names(expr), computes


def _same_state(a: Region, b_call: cst.CSTNode, names: Names) -> bool:
    ac = autocast_call(names, b_call)
    return ac is not None and ac.call.deep_equals(a.ac.call)


def computed_outside(ctx: Context, call: cst.Call, region: Region) -> str | None:
    """The name of the differentiated value when it was computed before ``region`` (and not in
    an identical autocast block): its backward runs under a state its forward did not."""
    from ampdoctor.lint.semantic.flow import flow_of

    value = differentiated(ctx.names, call)
    if value is None:
        return None
    read, computes = _reads(value)
    if computes or not read:
        return None
    fn = next((p for p in ctx.ancestors() if isinstance(p, cst.FunctionDef)), ctx.parents[0])
    flow = flow_of(ctx, fn)
    at = flow.pos(call)
    lo = -1 if region.node is fn else flow.pos(region.body)
    outside = None
    leaves = {n for n in read if not any(o.startswith(n + ".") for o in read)}
    for name in sorted(leaves):
        b = flow.binding_at(name, at)
        if b is None:
            if name in flow.params:
                outside = outside or name
            continue  # `self.loss` of another method, a global: not known here
        if b.start >= lo:
            return None  # (part of) it is computed in the region: the forward ran there
        around = [p for p in flow.ancestors(flow.nodes[b.start]) if isinstance(p, cst.With)]
        if any(_same_state(region, item.item, ctx.names) for w in around for item in w.items):
            return None  # computed in an identical autocast block: same state
        outside = outside or name
    return outside


def _disables(names: Names, node: cst.CSTNode) -> bool:
    """A ``with autocast(enabled=False)`` written in ``node`` (nested defs excluded)."""
    for n in h.walk(node):
        if isinstance(n, cst.With):
            for item in n.items:
                ac = autocast_call(names, item.item)
                if ac is not None and ac.enabled is False:
                    return True
    return False


def _decorated(names: Names, fn, wanted: set[str]) -> bool:
    return fn is not None and any(
        names.qualified(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) in wanted
        for d in fn.node.decorators)


def _forward_state_backward_not(ctx: Context, klass) -> bool:
    """A custom ``autograd.Function`` whose ``forward`` fixes its own autocast state
    (``custom_fwd``) while its ``backward`` has no ``custom_bwd``: run inside a region, the
    backward math is lowered although the forward was not. (Without ``custom_fwd`` the Function
    is AMP305's defect, and running its backward outside autocast can fail on mixed dtypes.)"""
    names = ctx.names
    if not any(names.qualified(b.value) in FUNCTION_BASES for b in klass.node.bases):
        return False
    bwd = klass.methods.get("backward")
    return bwd is not None and _decorated(names, klass.methods.get("forward"), _CUSTOM_FWD) and \
        not _decorated(names, bwd, _CUSTOM_BWD)


def float32_part(ctx: Context, call: cst.Call, region: Region) -> str | None:
    """What in ``region``, before ``call``, was recorded in another autocast state: a nested
    disabled block, a call of a file function that disables autocast, a custom Function without
    ``custom_bwd``. A short description, or None."""
    from ampdoctor.lint.semantic.facts import facts_of

    graph = facts_of(ctx).calls
    for n in h.walk(region.body):
        if n is call:
            break  # the nodes before it in source order
        if isinstance(n, cst.With) and any(
                (ac := autocast_call(ctx.names, item.item)) is not None and ac.enabled is False for item in n.items):
            return "holds an `autocast(enabled=False)` block"
        if not isinstance(n, cst.Call):
            continue
        callee = graph.callee(n)
        if callee is not None and _disables(ctx.names, callee.node.body):
            return f"calls `{callee.qualname}`, which disables autocast"
        mc = h.method_call(n, "apply")
        if mc is not None:
            d = dotted_name(mc[0])
            klass = graph.classes.get(d) if d is not None else None
            if klass is not None and _forward_state_backward_not(ctx, klass):
                return f"runs the custom `{klass.name}.backward` (no `custom_bwd`)"
    return None
