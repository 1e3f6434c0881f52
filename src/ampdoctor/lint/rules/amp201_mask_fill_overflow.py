from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import values as mu
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.flow import FunctionFlow, flow_of
from ampdoctor.lint.rule import FixSpec, Rule

# methods that keep the dtype of their receiver: `torch.ones(n, n).triu(1).masked_fill(...)`
_SAME_DTYPE = ("view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "triu", "tril", "transpose",
               "permute", "contiguous", "clone", "repeat", "flatten", "detach", "cuda", "cpu", "view_as",
               "masked_fill", "masked_fill_", "fill_", "__getitem__")
_FACTORIES = {"torch.zeros", "torch.ones", "torch.full", "torch.empty", "torch.rand", "torch.randn", "torch.arange",
              "torch.tensor", "torch.eye", "torch.linspace", "torch.as_tensor"}
_TENSOR_OF = {"torch.tensor", "torch.as_tensor", "torch.scalar_tensor"}
_GUARD_WORDS = ("dtype", "fp16", "half", "float16", "float32", "autocast", "finfo", "precision")
_CODE = cst.Module([])
_INTEGER_SUFFIXES = ("ids", "idx", "index", "indices", "label", "labels", "tokens", "_pos", "positions", "count",
                     "counts")


@dataclass
class _Candidate:
    call: cst.CSTNode  # the masked_fill call, or the `mask * C` product
    recv: cst.BaseExpression
    value: cst.BaseExpression
    fn: cst.FunctionDef | None
    guarded: bool
    additive: bool = False
    cast: cst.Call | None = None  # `.to(x.dtype)` that turns the constant into the runtime dtype
    scopes: tuple = ()  # the defs and classes around it


class MaskFillOverflow(Rule):
    """``masked_fill`` with a constant beyond the float16 range, in a file that uses float16."""

    code = "AMP201"
    name = "mask-fill-overflow"
    severity = Severity.ERROR
    message = ("`{call}` fills with {value}, which float16 cannot hold: on a float16 tensor (fp16 autocast, "
               "`.half()`) it raises \"value cannot be converted to type c10::Half without overflow\". "
               "Fill with `torch.finfo({recv}.dtype).{lim}` instead.")
    fix_title = "Fill with `torch.finfo({recv}.dtype).{lim}`"
    additive_message = ("`{expr}` multiplies a mask by {value}, which float16 cannot hold: when the mask is float16 "
                        "(fp16 autocast, `.half()`, `.to(dtype)`) the product is -inf, and a fully masked row then "
                        "gives NaN after softmax. Use `torch.finfo(dtype).min` of the scores' dtype instead.")
    cast_message = ("`{expr}` puts {value} into a tensor and casts it to a runtime dtype: in float16 "
                    "(`--fp16`, `.half()`, fp16 autocast) the constant becomes -inf, and a fully masked row "
                    "then gives NaN after softmax. Use `torch.finfo({dtype}).min` of that dtype instead.")
    fix_availability = "unsafe"
    words = (b"masked_fill", b"mask", b"where")
    also = (b"e9", b"e+9", b"e10", b"e+10", b"e12", b"e15", b"e18", b"e20", b"e30", b"e38", b"float32).max",
            b"float32).min", b"2**", b"2 **", b"0000000")
    summary = ("`masked_fill` or an additive `mask * C` mask with a constant such as -1e9 that overflows float16, "
               "in a file that uses float16.")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.candidates: list[_Candidate] = []

    def visit_Call(self, node: cst.Call) -> None:
        mc = h.method_call(node, "masked_fill", "masked_fill_")
        if mc is None:
            self._cast_of_constant(node)
            return
        if self.ctx.names.qualified(node.func) in ("torch.masked_fill", "torch.Tensor.masked_fill"):
            recv = h.arg(node, 0, "input")
            value = h.arg(node, 2, "value")
        else:
            recv = mc[0]
            value = h.arg(node, 1, "value")
        if recv is None or value is None or h.has_star_args(node):
            return
        self.candidates.append(_Candidate(node, recv, value, self._function(), self._dtype_guarded(),
                                           scopes=self._scopes()))

    def _cast_of_constant(self, node: cst.Call) -> None:
        """``torch.where(m, 0, -1e10).to(x.dtype)``: a constant tensor cast to a dtype known at run time."""
        mc = h.method_call(node, "to", "type_as", "type")
        if mc is None or not isinstance(mc[0], cst.Call) or not node.args:
            return
        inner = mc[0]
        q = self.ctx.names.qualified(inner.func) or ""
        if q not in ("torch.where", "torch.full", "torch.tensor", "torch.full_like", "torch.as_tensor"):
            return
        target = node.args[0].value
        if mc[1] == "to" and (h.dtype_of(self.ctx.names, target) is not None or h.string_value(target) is not None):
            return  # `.to(torch.float32)`, `.to("cuda")`: a fixed dtype or a device
        for a in inner.args:
            if isinstance(a.value, (cst.Integer, cst.Float, cst.UnaryOperation, cst.Name, cst.Attribute)):
                self.candidates.append(_Candidate(node, inner, a.value, self._function(), self._dtype_guarded(),
                                                  cast=node, scopes=self._scopes()))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        """Additive masks: `mask * -1e9`, `(1 - mask) * -1e9`, `-1e9 * mask`."""
        if not isinstance(node.operator, cst.Multiply):
            return
        for const, other in ((node.right, node.left), (node.left, node.right)):
            if isinstance(const, (cst.Integer, cst.Float, cst.UnaryOperation, cst.Name, cst.Attribute, cst.Call)) \
                    and any("mask" in n for n in h.names_in(other)) and not any("mask" in n for n in h.names_in(const)):
                self.candidates.append(_Candidate(node, other, const, self._function(), self._dtype_guarded(),
                                                  additive=True, scopes=self._scopes()))
                return

    def _scopes(self) -> tuple:
        return tuple(p for p in self.ctx.parents if isinstance(p, (cst.FunctionDef, cst.ClassDef)))

    def _function(self) -> cst.FunctionDef | None:
        scope = h.enclosing_scope(self.ctx)
        return scope if isinstance(scope, cst.FunctionDef) else None

    def _dtype_guarded(self) -> bool:
        """Inside ``if x.dtype == torch.float16`` (or any precision test): the author chose the value per dtype."""
        for p in self.ctx.ancestors():
            if isinstance(p, (cst.If, cst.IfExp, cst.While)):
                words = " ".join(h.names_in(p.test))
                if any(w in words for w in _GUARD_WORDS):
                    return True
            if isinstance(p, h.SCOPES):
                return False
        return False

    def leave_Module(self, node: cst.Module) -> None:
        if not self.candidates:
            return
        names = self.ctx.names
        consts = mu.module_constants(node, names)
        flows: dict[int, FunctionFlow] = {}
        found = []
        for c in self.candidates:
            if c.guarded:
                continue
            flow = None
            if c.fn is not None:
                flow = flows.get(id(c.fn))
                if flow is None:
                    flow = flows[id(c.fn)] = flow_of(self.ctx, c.fn)
            v = self._value(c.value, consts, flow, c.call)
            if v is None or v != v or abs(v) <= mu.FP16_MAX or v in (float("inf"), float("-inf")):
                continue
            if c.cast is None and (self._wide(c.recv, flow, c.call, 0) or self._integer_like(c.recv)):
                continue
            if not c.additive and c.cast is None and self._bool_mask_times_float(c):
                continue
            if c.additive and any(mu.is_upcast(names, n) for n in h.walk(c.recv, enter_scopes=True)):
                continue  # `(1.0 - mask.float()) * -1e9` stays float32
            found.append((c, v))
        if not found:
            return
        evidence = facts_of(self.ctx).evidence
        for c, v in found:
            if evidence.fp16_for(list(c.scopes)) is None:
                continue
            if c.cast is not None:
                target = c.cast.args[0].value
                dtype = _CODE.code_for_node(target) if dotted_name(target) else "dtype"
                if c.cast.func.attr.value in ("type_as",):  # type: ignore[attr-defined]
                    dtype += ".dtype"
                self.report(c.call, self.cast_message.format(expr=" ".join(_CODE.code_for_node(c.call).split()),
                                                             value=f"`{_CODE.code_for_node(c.value).strip()}`", dtype=dtype))
                continue
            if c.additive:
                expr = _CODE.code_for_node(c.call).strip()
                self.report(c.call, self.additive_message.format(expr=expr, value=f"{v:g}"))
                continue
            recv = dotted_name(c.recv)
            lim = "min" if v < 0 else "max"
            call_text = _CODE.code_for_node(c.call.func)
            value_text = f"`{_CODE.code_for_node(c.value).strip()}`"
            if h.number_value(c.value) is None:
                value_text += f" (= {v:.3g})"
            msg = self.message.format(call=f"{call_text}(...)", value=value_text,
                                      recv=recv or "x", lim=lim)
            self.report(c.call, msg, self._fix(c, recv, lim))

    def _value(self, value, consts, flow, call) -> float | None:
        if isinstance(value, cst.Call) and self.ctx.names.qualified(value.func) in _TENSOR_OF and value.args:
            value = value.args[0].value
        if flow is not None:
            consts = mu.local_constants(self.ctx.names, flow, consts, flow.pos(call), _GUARD_WORDS)
        return mu.const_value(self.ctx.names, value, consts)

    @staticmethod
    def _bool_mask_times_float(c: _Candidate) -> bool:
        """``(mask * 1.0).masked_fill(mask, -1e9)``: ``mask`` is the boolean mask of the fill, so
        the product with a Python float is float32 (petals' Falcon block), whatever autocast does."""
        recv = c.recv
        if not isinstance(recv, cst.BinaryOperation) or not isinstance(recv.operator, (cst.Multiply, cst.Add)):
            return False
        sides = (recv.left, recv.right)
        if not any(isinstance(x, cst.Float) for x in sides):
            return False
        other = next(x for x in sides if not isinstance(x, cst.Float))
        call = c.call
        mask = call.args[0].value if isinstance(call, cst.Call) and call.args else None
        return mask is not None and dotted_name(other) is not None and dotted_name(other) == dotted_name(mask)

    @staticmethod
    def _integer_like(expr) -> bool:
        """`input_ids`, `labels`, `positions`...: integer tensors hold 1e9 fine."""
        d = dotted_name(expr)
        if d is None:
            return False
        last = d.rsplit(".", 1)[-1].lower()
        return last.endswith(_INTEGER_SUFFIXES) or last in ("idx", "index", "indices", "positions", "pos")

    def _wide(self, expr, flow, at, depth: int) -> bool:
        """Whether ``expr`` is known to be a float32/float64 tensor (or a factory default-dtype one)."""
        names = self.ctx.names
        while True:
            if mu.is_upcast(names, expr):
                return True
            if isinstance(expr, cst.Subscript):
                expr = expr.value
                continue
            mc = h.method_call(expr, *_SAME_DTYPE)
            if mc is not None:
                expr = mc[0]
                continue
            mc = h.method_call(expr, "to")
            if mc is not None and not any(a.keyword is not None and a.keyword.value == "dtype" for a in expr.args) \
                    and len(expr.args) == 1 and h.dtype_of(names, expr.args[0].value) is None \
                    and not isinstance(expr.args[0].value, (cst.Name, cst.Attribute)):
                expr = mc[0]  # `.to("cuda")`
                continue
            break
        if isinstance(expr, cst.Call):
            q = names.qualified(expr.func)
            if q in _FACTORIES:
                dt = h.arg(expr, None, "dtype")
                return dt is None or h.dtype_of(names, dt) in ("float32", "float64")
            return False
        if flow is None or depth > 3:
            return False
        d = dotted_name(expr)
        if d is None:
            return False
        b = flow.binding_at(d, flow.pos(at))
        if b is None or b.aug or b.value is None:
            return False
        return self._wide(b.value, flow, flow.nodes[b.start], depth + 1)

    def _fix(self, c: _Candidate, recv: str | None, lim: str) -> FixSpec | None:
        if recv is None:
            return None
        torch_name = self.ctx.names.local_name_for("torch")
        imports: tuple[str, ...] = ()
        if torch_name is None:
            torch_name, imports = "torch", ("torch",)
        new = cst.parse_expression(f"{torch_name}.finfo({recv}.dtype).{lim}")
        return FixSpec(((c.value, new),), safe=False, title=self.fix_title.format(recv=recv, lim=lim),
                       imports=imports)
