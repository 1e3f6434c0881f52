from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import models as nu
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import Rule

_LOADERS = ("from_pretrained", "from_config", "from_single_file")


class T5Fp16(Rule):
    """A T5-family model cast to float16."""

    code = "AMP212"
    name = "t5-fp16"
    severity = Severity.WARNING
    message = ("`{conv}` runs a {family} model in float16: T5's feed-forward activations can exceed float16's "
               "maximum (65504), which gives inf/NaN outputs and losses. Use bfloat16 or float32{keep}.")
    keep_hint = ", or load with `torch_dtype=torch.float16` and no later cast, which keeps `wo` in float32"
    words = (b"t5", b"T5")
    also = (b".half", b"float16", b"fp16")
    summary = "`.half()`/`.to(torch.float16)` on a T5/mT5/LongT5 model, which overflows in float16."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # dotted name -> "t5"/"longt5" for names bound to a T5 model or checkpoint string
        self.t5_names: dict[str, str] = {}
        self.strings: dict[str, str] = {}

    # -- what is a T5 model ----------------------------------------------------------------
    def _kind(self, expr: cst.CSTNode | None, depth: int = 0) -> str | None:
        """"t5"/"longt5" when ``expr`` evaluates to a T5-family model (or checkpoint name)."""
        if expr is None or depth > 4:
            return None
        if isinstance(expr, (cst.Name, cst.Attribute)):
            d = dotted_name(expr)
            if d in self.t5_names:
                return self.t5_names[d]
            if d in self.strings:
                return nu.t5_kind(self.strings[d])
            return None
        s = h.string_value(expr)
        if s is not None:
            return nu.t5_kind(s) if len(s) < 200 else None
        if isinstance(expr, cst.Call):
            q = self.ctx.names.qualified(expr.func) or ""
            parts = q.split(".")
            if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _LOADERS:
                cls = parts[-2] if len(parts) >= 2 else ""
                k = nu.t5_kind(cls) if _is_class_name(cls) else None
                if k is not None:
                    return k
                if cls.startswith("Auto") or "pipeline" in cls.lower() or not cls:
                    first = h.arg(expr, 0, "pretrained_model_name_or_path")
                    return self._kind(first, depth + 1)
                return None
            if parts and _is_class_name(parts[-1]):
                return nu.t5_kind(parts[-1])
            if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in nu.MODULE_CHAIN:
                return self._kind(expr.func.value, depth + 1)
        return None

    def leave_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            d = dotted_name(t.target)
            if d is None:
                continue
            s = h.string_value(node.value)
            if s is not None:
                self.strings[d] = s
                continue
            self.strings.pop(d, None)
            k = self._kind(node.value) if not isinstance(node.value, cst.SimpleString) else None
            if k is not None:
                self.t5_names[d] = k
            else:
                self.t5_names.pop(d, None)

    # -- the casts ---------------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        if nu.is_fp16_conversion(names, node):
            assert isinstance(node.func, cst.Attribute)
            recv = node.func.value
            if isinstance(recv, (cst.Name, cst.Attribute)):
                k = self.t5_names.get(dotted_name(recv) or "")
            else:
                k = self._kind(recv)
            if k is None:
                res = nu.conversion_result(self.ctx, node)
                if res is None or not res[2]:
                    return
                k = next((self.t5_names[t] for t in res[0] if t in self.t5_names), None)
                if k is None:
                    return
            self._flag(node, k, cast=True)
            return
        # LongT5 has no `_keep_in_fp32_modules`: loading it in float16 is enough to overflow
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "from_pretrained":
            dt = h.arg(node, None, "torch_dtype") or h.arg(node, None, "dtype")
            if dt is not None and h.dtype_of(names, dt) == "float16" and self._kind(node) == "longt5":
                self._flag(node, "longt5", cast=False)

    def _flag(self, node: cst.Call, kind: str, cast: bool) -> None:
        family = {"t5": "T5-family", "longt5": "LongT5"}[kind]
        keep = self.keep_hint if kind == "t5" and cast else ""
        self.report(node, self.message.format(conv=source.short(node, 50), family=family, keep=keep))


def _is_class_name(s: str) -> bool:
    return bool(s) and s[0].isupper() and any(c.islower() for c in s)
