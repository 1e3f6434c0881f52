from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import edits
from ampdoctor.lint.rule import FixSpec, Rule

# torch.<old>(args) -> torch.<new>("<device>", args); each of these warns
# "torch.<old>() is deprecated. Please use torch.<new>('<device>') instead." (checked with torch 2.13)
_DEPRECATED: dict[str, tuple[str, str]] = {}
for _dev, _name in (("cpu", "cpu"), ("cuda", "gpu"), ("ipu", "ipu"), ("xla", "xla")):
    _DEPRECATED[f"get_autocast_{_name}_dtype"] = ("get_autocast_dtype", _dev)
    _DEPRECATED[f"set_autocast_{_name}_dtype"] = ("set_autocast_dtype", _dev)
for _dev in ("cpu", "ipu", "xla"):
    _DEPRECATED[f"is_autocast_{_dev}_enabled"] = ("is_autocast_enabled", _dev)
    _DEPRECATED[f"set_autocast_{_dev}_enabled"] = ("set_autocast_enabled", _dev)
_QUALIFIED = {f"torch.{k}": k for k in _DEPRECATED}
_QUALIFIED.update({f"torch._C.{k}": k for k in _DEPRECATED})
# torch.get_autocast_dtype(device_type) and friends arrived with pytorch#124359 (torch 2.4)
_NEEDS = (2, 4)


_NEW_API = {f"torch.{n}" for n, _ in _DEPRECATED.values()}


def _is_new_api(q: str) -> bool:
    return q in _NEW_API


class DeprecatedAutocastGetter(Rule):
    """``torch.get_autocast_gpu_dtype()`` and the other per-device autocast getters/setters."""

    code = "AMP502"
    name = "deprecated-autocast-getter"
    severity = Severity.INFO
    message = ("`torch.{old}()` is deprecated (it emits a DeprecationWarning). "
               "Use `torch.{new}(\"{dev}\"{rest})`.")
    fix_title = "Use the device-generic autocast API"
    fix_availability = "safe"
    words = (b"autocast_gpu_", b"autocast_cpu_", b"autocast_ipu_", b"autocast_xla_")
    summary = "Deprecated per-device autocast state functions such as `torch.get_autocast_gpu_dtype()`."

    def visit_Call(self, node: cst.Call) -> None:
        q = self.ctx.names.qualified(node.func)
        old = _QUALIFIED.get(q or "")
        if old is None or branches.in_version_guard(self.ctx) or branches.in_fallback(self.ctx, _is_new_api):
            return
        new, dev = _DEPRECATED[old]
        rest = ", ..." if old.startswith("set_") else ""
        msg = self.message.format(old=old, new=new, dev=dev, rest=rest)
        self.report(node, msg, self._fix(node, new, dev))

    def _fix(self, node: cst.Call, new: str, dev: str) -> FixSpec | None:
        if self.ctx.min_torch is not None and tuple(self.ctx.min_torch) < _NEEDS:
            return None
        if any(a.star for a in node.args) or any(a.keyword is not None for a in node.args):
            return None
        imports: tuple[str, ...] = ()
        if isinstance(node.func, cst.Attribute) and self.ctx.names.qualified(node.func.value) == "torch":
            func = node.func.with_changes(attr=cst.Name(new))
        else:
            torch_name, imports = edits.torch_local(self.ctx.names)
            func = edits.attr_chain(f"{torch_name}.{new}")
        first = cst.Arg(edits.string(dev))
        if node.args:
            first = first.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return FixSpec(((node, node.with_changes(func=func, args=[first, *node.args])),), safe=True,
                       title=self.fix_title, imports=imports)
