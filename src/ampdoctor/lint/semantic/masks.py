"""-inf masks before a softmax: which fills hide padding, whether a causal mask applies to the
same scores, and whether fully masked rows are handled.

``NegInfFill`` is a Rule base class (not registered) that finds ``masked_fill``/``where`` fills
with -inf whose result reaches a softmax in the same function, where the mask marks padding that
comes from outside the function. Each such fill is classified: ``causal`` when the function
also applies a causal mask to those scores (so a left-padded query row can see only padding),
else ``padding`` (a row is fully masked only if a whole sequence is padding). Subclasses set
``reports`` to the kind they flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import values as mu
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic.flow import FunctionFlow, flow_of
from ampdoctor.lint.rule import Rule

_CODE = cst.Module([])
# a mask built from these can never hide a whole row: the diagonal stays visible
_CAUSAL = ("causal", "tril", "triu", "future", "subsequent", "look_ahead", "lookahead", "autoregressive",
           "upper", "lower", "diag", "window", "sliding", "band", "chunk", "local")
# words that name a causal (or windowed) mask for sure: `tril`, `causal_mask`, `is_causal`
_CAUSAL_STRICT = ("causal", "tril", "triu", "subsequent", "look_ahead", "lookahead", "autoregressive")
# a mask built from these marks padding: a sequence that is all padding masks a whole row
_PADDING = ("pad", "valid")
# a mask over image pixels or patches: padding added to fit the batch never covers a whole image
_IMAGE = ("img", "image", "pixel", "spatial", "patch")


@dataclass
class _Fill:
    call: cst.Call
    recv: cst.BaseExpression | None
    mask: cst.BaseExpression
    value: cst.BaseExpression
    kind: str  # "masked_fill" or "where"


class NegInfFill(Rule):
    """Base class: -inf fills of padding masks that reach a softmax (see the module doc)."""

    reports = "causal"  # the kind of fill this rule flags: "causal" or "padding"
    words = (b"masked_fill", b"where(")
    also = (b"inf",)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.module: cst.Module | None = None
        self._consts: dict[str, float] | None = None
        self.fills: dict[int, list[_Fill]] = {}  # id(function) -> candidate fills

    def visit_Module(self, node: cst.Module) -> None:
        self.module = node

    def visit_Call(self, node: cst.Call) -> None:
        fn = h.enclosing_scope(self.ctx)
        if not isinstance(fn, cst.FunctionDef) or h.has_star_args(node):
            return
        names = self.ctx.names
        q = names.qualified(node.func)
        fill = None
        fills = []
        if q in ("torch.masked_fill", "torch.Tensor.masked_fill"):
            recv, mask, value = h.arg(node, 0, "input"), h.arg(node, 1, "mask"), h.arg(node, 2, "value")
            if recv is not None and mask is not None and value is not None:
                fill = _Fill(node, recv, mask, value, "masked_fill")
        elif q == "torch.where":
            cond, a, b = h.arg(node, 0, "condition"), h.arg(node, 1, "input"), h.arg(node, 2, "other")
            if cond is not None and a is not None and b is not None:
                fills = [_Fill(node, b, cond, a, "where"), _Fill(node, a, cond, b, "where")]
        else:
            mc = h.method_call(node, "masked_fill", "masked_fill_")
            if mc is not None:
                mask, value = h.arg(node, 0, "mask"), h.arg(node, 1, "value")
                if mask is not None and value is not None:
                    fill = _Fill(node, mc[0], mask, value, "masked_fill")
        if fill is not None:
            fills.append(fill)
        for f in fills:
            if self._maybe_inf(f.value):
                self.fills.setdefault(id(fn), []).append(f)

    def _maybe_inf(self, node) -> bool:
        """A cheap first look: a literal -inf, or a name that may be bound to one."""
        if isinstance(node, cst.Name):
            return True
        v = mu.const_value(self.ctx.names, node)
        return v is not None and v == -math.inf

    def _constants(self) -> dict[str, float]:
        if self._consts is None:
            self._consts = mu.module_constants(self.module, self.ctx.names) if self.module is not None else {}
        return self._consts

    def possible(self) -> bool:
        """Whether the file shows that the fully masked row this rule describes can occur."""
        return True

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        fills = self.fills.pop(id(node), None)
        if not fills:
            return
        flow = flow_of(self.ctx, node)
        softmaxes = [(n, inp) for n in flow.nodes if (inp := self._softmax_input(n)) is not None]
        if not softmaxes:
            return
        reported: set[int] = set()
        for f in fills:
            if id(f.call) in reported:
                continue
            at = flow.pos(f.call)
            consts = mu.local_constants(self.ctx.names, flow, self._constants(), at)
            if mu.const_value(self.ctx.names, f.value, consts) != -math.inf:
                continue
            sm = self._reaches_softmax(f, flow, softmaxes)
            if sm is None or not self._padding(f.mask, flow, at) or self._guarded(f, flow, sm):
                continue
            kind = "causal" if self._causal_too(node, f) else "padding"
            if kind != self.reports or not self.possible():
                continue
            recv = dotted_name(f.recv) if f.recv is not None else None
            call = _CODE.code_for_node(f.call).strip()
            if len(call) > 70:
                call = _CODE.code_for_node(f.call.func).strip() + "(...)"
            reported.add(id(f.call))
            self.report(f.call, self.message.format(call=call, recv=recv or "scores"))

    def _causal_too(self, fn: cst.FunctionDef, f: _Fill) -> bool:
        """The function also applies a causal (or sliding-window) mask: the fill's own mask is
        combined with one (`pad & causal`), or another fill or addition of a causal mask acts on
        the scores. Then a left-padded query row sees only padded keys."""
        own = {id(n) for n in [f.mask, *h.walk(f.mask, enter_scopes=True)]}
        for n in h.walk(fn.body, enter_scopes=True):
            if isinstance(n, cst.Name) and id(n) not in own and any(w in n.value.lower() for w in _CAUSAL_STRICT):
                return True
            if isinstance(n, cst.Attribute) and any(w in n.attr.value.lower() for w in _CAUSAL_STRICT):
                return True
        return any(any(w in name for w in _CAUSAL_STRICT) for name in _words_of(f.mask))

    # -- data flow ---------------------------------------------------------------------
    def _softmax_input(self, n: cst.CSTNode) -> cst.BaseExpression | None:
        return mu.softmax_input(self.ctx.names, n)

    def _reaches_softmax(self, f: _Fill, flow: FunctionFlow, softmaxes) -> cst.CSTNode | None:
        for sm, inp in softmaxes:
            if flow.within(f.call, inp):
                return sm
        seed: set[str] = set()
        if h.method_call(f.call, "masked_fill_") and f.recv is not None:
            base = f.recv
            while isinstance(base, cst.Subscript):
                base = base.value
            d = dotted_name(base)
            if d is not None:
                seed.add(d)
        start, tainted = flow.derived(f.call, seed)
        if not tainted:
            return None
        fill_arms = flow.branches(f.call)
        for sm, inp in softmaxes:
            if flow.pos(sm) > start and tainted & mu.expr_names(inp) and \
                    not h.exclusive(fill_arms, flow.branches(sm)):  # not the `else:` of the fill's `if`
                return sm
        return None

    def _padding(self, mask: cst.BaseExpression, flow: FunctionFlow, at: int) -> bool:
        """Whether the mask marks padding that comes from outside the function.

        The mask is followed back through local bindings. It counts as padding when a data name
        in that derivation says so (`*pad*`, `*valid*`, `*lengths`, `*lens`; callees such as
        `F.pad` do not count), or when it reads a `*mask*` parameter (other than the generic
        `attn_mask`) and nothing in it looks causal (`triu`, `tril`, `causal`, a `self.bias`
        buffer...). Either way it must read a parameter or an attribute of `self` beyond their
        shape, device and dtype: a mask synthesised from sizes alone hides no real padding.
        """
        seen: set[tuple[str, int]] = set()
        data_words: set[str] = set()
        all_words: set[str] = set()
        mask_param = provenance = buffers = False
        todo = [(mask, at, 0)]
        while todo:
            expr, pos, depth = todo.pop()
            data, callees = _data_names(expr, flow)
            for n in [expr, *h.walk(expr, enter_scopes=True)]:
                if isinstance(n, cst.Name):
                    all_words.add(n.value.lower())
            for n in data:
                word = (n.value if isinstance(n, cst.Name) else n.attr.value).lower()
                data_words.add(word)
                if isinstance(n, cst.Name) and n.value in flow.params and n.value not in ("self", "cls"):
                    provenance = True
                    if "mask" in word and "attn_mask" not in word:
                        mask_param = True
                d = dotted_name(n) if isinstance(n, cst.Attribute) else None
                if d is not None and d.startswith("self."):
                    provenance = True
                    if "mask" in d.lower() or "bias" in d.lower():
                        buffers = True  # a registered (causal) mask buffer: `self.bias[..., :n, :n]`
            all_words |= callees
            if depth >= 4:
                continue
            for n in data:
                name = dotted_name(n)
                if name is None:
                    continue
                b = flow.binding_at(name, pos)
                if b is not None and b.value is not None and (name, b.start) not in seen:
                    seen.add((name, b.start))
                    todo.append((b.value, b.start, depth + 1))
        if not provenance:
            return False
        if "flatten" in all_words or any(any(w in word for w in _IMAGE) for word in all_words):
            return False  # an image padding mask (flattened H x W): every image keeps its own pixels
        if any(any(p in w for p in _PADDING) or w.endswith(("lengths", "lens")) for w in data_words):
            return True
        text = " ".join(all_words)
        return mask_param and not any(w in text for w in _CAUSAL) and not buffers

    def _guarded(self, f: _Fill, flow: FunctionFlow, sm: cst.CSTNode) -> bool:
        """Fully masked rows are handled: NaNs cleaned after the softmax, rows zeroed by a second
        fill, or the mask tested with `.all()`/`.any()`."""
        mask_names = mu.expr_names(f.mask)
        for n in flow.nodes:
            if not isinstance(n, cst.Call):
                continue
            q = self.ctx.names.qualified(n.func) or ""
            last = n.func.attr.value if isinstance(n.func, cst.Attribute) else q.rsplit(".", 1)[-1]
            if last in ("nan_to_num", "nan_to_num_", "isnan", "isfinite", "isinf", "isneginf", "_safe_softmax"):
                return True
            if last in ("all", "any") and mask_names & mu.expr_names(n):
                return True
            if (flow.pos(n) > flow.pos(sm) or flow.within(sm, n)) and last in ("masked_fill", "masked_fill_", "where"):
                # a second fill after the softmax, or around it: `softmax(s).masked_fill(mask, 0.0)`
                for a in n.args:
                    if h.number_value(a.value) == 0:
                        return True
        return False


_META_ATTRS = ("shape", "device", "dtype", "ndim", "is_cuda", "layout")
_META_METHODS = ("size", "dim", "numel", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "type_as")


def _data_names(expr: cst.CSTNode, flow: FunctionFlow) -> tuple[list[cst.CSTNode], set[str]]:
    """The names and attributes whose values an expression reads (not only their shape, device or
    dtype), and the lower-cased names of the functions and methods it calls."""
    skip: set[int] = set()
    callees: set[str] = set()
    nodes = [expr, *h.walk(expr, enter_scopes=True)]
    local = set(flow.params) | {b.name for b in flow.bindings}
    for n in nodes:
        if isinstance(n, cst.Attribute) and n.attr.value in _META_ATTRS:
            skip.add(id(n))
            skip.update(id(m) for m in [n.value, *h.walk(n.value, enter_scopes=True)])
        elif isinstance(n, cst.Call):
            skip.update(id(a.keyword) for a in n.args if a.keyword is not None)
            func = n.func
            if isinstance(func, cst.Name):
                skip.add(id(func))
                callees.add(func.value.lower())
            elif isinstance(func, cst.Attribute):
                skip.add(id(func))
                skip.add(id(func.attr))
                callees.add(func.attr.value.lower())
                base = func.value
                if func.attr.value in _META_METHODS or (
                        isinstance(base, (cst.Name, cst.Attribute)) and (dotted_name(base) or "") not in local
                        and not (dotted_name(base) or "").startswith("self.")):
                    # `x.size(1)`, `torch.tril(...)`, `F.pad(...)`, `self.helper(...)`
                    skip.update(id(m) for m in [base, *h.walk(base, enter_scopes=True)])
    out = []
    for n in nodes:
        if id(n) in skip:
            continue
        if isinstance(n, cst.Attribute):
            out.append(n)
            # its parts are covered by the chain itself
            skip.update(id(m) for m in h.walk(n, enter_scopes=True) if isinstance(m, (cst.Name, cst.Attribute)))
        elif isinstance(n, cst.Name):
            out.append(n)
    return out, callees


def _words_of(expr: cst.CSTNode) -> set[str]:
    return {n.value.lower() for n in [expr, *h.walk(expr, enter_scopes=True)] if isinstance(n, cst.Name)}
