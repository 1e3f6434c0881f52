"""Autocast: what one ``autocast(...)`` call does, and which autocast regions run around a node.

A region is a ``with autocast(...)`` block of the same function or an ``@autocast(...)``
decorator of that function (a def written inside ``with autocast()`` does not run in it), or
one inherited from the callers: a function of the file that is only ever called, in the file,
inside autocast regions runs in them too (``regions(ctx, inherited=True)``).
"""

from __future__ import annotations

import libcst as cst

from ampdoctor.lint.helpers import arg, dtype_of, string_value
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.rule import Context

# torch.autocast(device_type, dtype, enabled, cache_enabled) and the device-specific
# torch.cuda.amp.autocast(enabled, dtype, cache_enabled): where cache_enabled sits
_CACHE_POS_GENERIC = 3
_CACHE_POS_DEVICE = 2

AUTOCAST_GENERIC = {"torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast"}
AUTOCAST_CUDA = {"torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast", "torch.cuda.autocast"}
AUTOCAST_CPU = {"torch.cpu.amp.autocast", "torch.cpu.amp.autocast_mode.autocast", "torch.cpu.autocast"}
AUTOCAST_ALL = AUTOCAST_GENERIC | AUTOCAST_CUDA | AUTOCAST_CPU

# the device-specific API takes no device: its first positional parameter
_DEVICE_SPECIFIC_FIRST = {
    **{q: "enabled" for q in ("torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast",
                              "torch.cpu.amp.autocast", "torch.cpu.amp.autocast_mode.autocast")},
    **{q: "init_scale" for q in ("torch.cuda.amp.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
                                 "torch.cpu.amp.GradScaler", "torch.cpu.amp.grad_scaler.GradScaler")},
}


def device_string_misplaced(names: Names, call: cst.CSTNode) -> tuple[str, str] | None:
    """``torch.cuda.amp.GradScaler("cuda", ...)``, ``torch.cuda.amp.autocast("cuda")``: a string
    (meant as the device, as ``torch.amp`` takes it) given as the first positional argument of
    the device-specific API, where it becomes ``init_scale`` / ``enabled``, and the first
    ``scale()`` / entering the region raises TypeError. Returns (that parameter, the string)."""
    if not isinstance(call, cst.Call) or not call.args:
        return None
    base = call.func
    while isinstance(base, cst.Attribute):
        base = base.value
    if isinstance(base, cst.Name) and base.value in names.reimported:
        return None  # the device-generic API where the installed torch has it
    param = _DEVICE_SPECIFIC_FIRST.get(names.qualified(call.func) or "")
    first = call.args[0]
    if param is None or first.keyword is not None or first.star or \
            not isinstance(first.value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return None
    return param, string_value(first.value) or "..."


class Autocast:
    """What is statically known about one ``autocast(...)`` call."""

    __slots__ = ("call", "qualified", "device", "dtype", "dtype_expr", "enabled")

    def __init__(self, call, qualified, device, dtype, dtype_expr, enabled) -> None:
        self.call = call
        self.qualified = qualified
        self.device: str | None = device  # "cuda", "cpu", ... or None when not a literal
        self.dtype: str | None = dtype  # "float16"/"bfloat16"/... explicit, or None
        self.dtype_expr = dtype_expr  # the dtype argument expression, None when absent
        self.enabled: bool | None = enabled  # False for a literal False, None when unknown

    @property
    def effective_dtype(self) -> str | None:
        """The dtype the block computes in, when known: explicit, else the device default."""
        if self.dtype_expr is not None:
            return self.dtype
        if self.device == "cuda":
            return "float16"
        if self.device == "cpu":
            return "bfloat16"
        return None


def _bool_value(node) -> bool | None:
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


def autocast_call(names: Names, call: cst.CSTNode) -> Autocast | None:
    """Describe an autocast call (also through ``functools.partial`` aliases), else None."""
    if not isinstance(call, cst.Call):
        return None
    q = names.qualified(call.func)
    if q not in AUTOCAST_ALL:
        return None
    args = list(call.args)
    partial = names.partials.get(dotted_name(call.func) or "")
    if partial is not None:
        args = list(partial.args[1:]) + args
    merged = call.with_changes(args=args) if args is not call.args else call
    if q in AUTOCAST_GENERIC:
        dev_expr = arg(merged, 0, "device_type")
        device = string_value(dev_expr)
        if device is not None:
            device = device.split(":", 1)[0]
        dtype_expr = arg(merged, 1, "dtype")
        enabled_expr = arg(merged, 2, "enabled")
    else:
        device = "cuda" if q in AUTOCAST_CUDA else "cpu"
        enabled_expr = arg(merged, 0, "enabled")
        dtype_expr = arg(merged, 1, "dtype")
    dtype = dtype_of(names, dtype_expr)
    enabled = _bool_value(enabled_expr) if enabled_expr is not None else True
    if enabled_expr is not None and enabled is None:
        enabled = None
    return Autocast(call, q, device, dtype, dtype_expr, enabled)


class Region:
    """An autocast region and the node that opens it: a ``With``, a decorated ``FunctionDef``,
    or, for an inherited region, the call site in the caller (``via`` is that call)."""

    __slots__ = ("ac", "node", "via")

    def __init__(self, ac: Autocast, node: cst.CSTNode, via: cst.Call | None = None) -> None:
        self.ac = ac
        self.node = node
        self.via = via

    @property
    def body(self) -> cst.CSTNode:
        return self.node.body  # type: ignore[attr-defined]


def lexical_regions(names: Names, stack: list[cst.CSTNode]) -> tuple[list[Region], cst.FunctionDef | None]:
    """Regions written around ``stack[-1]`` in its own function, innermost first, and that function
    (None at module level or inside a lambda/class body)."""
    out: list[Region] = []
    for i in range(len(stack) - 2, -1, -1):
        p = stack[i]
        if isinstance(p, cst.With) and stack[i + 1] is p.body:
            for item in p.items:
                ac = autocast_call(names, item.item)
                if ac is not None:
                    out.append(Region(ac, p))
        elif isinstance(p, cst.FunctionDef):
            for d in p.decorators:
                ac = autocast_call(names, d.decorator)
                if ac is not None:
                    out.append(Region(ac, p))
            return out, p
        elif isinstance(p, (cst.Lambda, cst.ClassDef)):
            return out, None
    return out, None


def regions(ctx: Context, inherited: bool = False) -> list[Region]:
    """Autocast regions that run around the current node, innermost first. With ``inherited``,
    when the node's own function has none, the regions every in-file caller runs it in."""
    out, fn = lexical_regions(ctx.names, ctx.parents)
    if inherited and not out and fn is not None:
        from ampdoctor.lint.semantic.facts import facts_of

        region = facts_of(ctx).calls.inherited_region(fn)
        if region is not None:
            out.append(region)
    return out


def enclosing_autocasts(ctx: Context, inherited: bool = False) -> list[Autocast]:
    return [r.ac for r in regions(ctx, inherited)]


def in_autocast(ctx: Context, inherited: bool = False) -> Autocast | None:
    """The innermost autocast region around the current node that is (or may be) enabled."""
    r = active_region(ctx, inherited)
    return r.ac if r is not None else None


def active_region(ctx: Context, inherited: bool = False) -> Region | None:
    """The innermost autocast region around the current node when it is (or may be) enabled."""
    rs = regions(ctx, inherited)
    if rs and rs[0].ac.enabled is not False:
        return rs[0]
    return None


def cache_enabled(ac: Autocast) -> bool | None:
    """The literal ``cache_enabled`` of an autocast call (None when absent or not a literal)."""
    pos = _CACHE_POS_GENERIC if ac.qualified in AUTOCAST_GENERIC else _CACHE_POS_DEVICE
    v = arg(ac.call, pos, "cache_enabled")
    if isinstance(v, cst.Name) and v.value in ("True", "False"):
        return v.value == "True"
    return None
