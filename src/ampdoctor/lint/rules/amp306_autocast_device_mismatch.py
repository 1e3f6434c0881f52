from __future__ import annotations

import re

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import edits
from ampdoctor.lint.semantic import source
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic.flow import flow_of
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs

# the device types torch.device accepts (c10 DeviceType names)
_DEVICE_TYPES = {"cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
                 "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"}
_NOT_A_DEVICE = {"gpu", "nvidia", "cuda0"}
_PLACEMENT = {"cpu", "cuda", "mps", "xpu"}
_HOST = ("numpy", "tolist", "item")  # what a tensor moved to the CPU for the host is turned into
_DEVICE_STR = re.compile(r"^(cpu|cuda|mps|xpu|hpu|xla|mtia|maia)(:\d+)?$")
_TORCH_DEVICE = {"torch.device"}
_INDEXED_TEXT = re.compile(r"\b(cuda|xpu|npu|mps):(\d|%|\{)")


def _makes_indexed_devices(module: cst.Module) -> bool:
    """The file builds indexed devices: "cuda:0", f"cuda:{rank}", "cuda:%d" % i, "cuda:" + str(i),
    ``torch.device("cuda", local_rank)``: a device it passes around may then print as "cuda:N"."""
    for n in h.walk(module, enter_scopes=True):
        if isinstance(n, cst.SimpleString):
            v = h.string_value(n) or ""
            if _INDEXED_TEXT.search(v) or v.rstrip() in ("cuda:", "xpu:", "npu:"):
                return True
        elif isinstance(n, cst.FormattedStringText):
            if re.search(r"\b(cuda|xpu|npu):$", n.value) or _INDEXED_TEXT.search(n.value):
                return True
        elif isinstance(n, cst.Call) and dotted_name(n.func) in ("torch.device", "device") and len(n.args) >= 2:
            return True
    return False

_RAISES = ("`{call}` raises RuntimeError: {arg} is not a device type. Use `device_type={fix}`.")
_INDEXED = ("`device_type={arg}` is a device, not a device type: torch releases before the generic "
            "autocast API raise RuntimeError on it, and current ones skip the CUDA checks of autocast. "
            "Use `device_type=\"{fix}\"`.")
_STR_DEVICE = ("`device_type={arg}` is \"cuda:0\" for an indexed device, which is not a device type: "
               "older torch raises, and current torch skips the CUDA checks of autocast. "
               "Use `device_type={dev}.type`.")
_TORCH_DEVICE_MSG = ("`{call}` passes a `torch.device` where `torch.autocast` needs a string: it raises "
                     "ValueError (\"Expected `device_type` of type `str`\"). Use `device_type={fix}`.")
_MISMATCH = ("This autocast uses device_type \"{ac}\" but this function puts its tensors on \"{dev}\": "
             "autocast only changes ops on its own device type, so the region runs in float32. "
             "Use `device_type=\"{dev}\"`, or `device.type` of the device the tensors live on.")


class _Scope:
    __slots__ = ("params", "evidence")

    def __init__(self, params: set[str]) -> None:
        self.params = params
        # device types the function placed tensors on so far (None: a placement we cannot read),
        # with the if/try branches they sit in
        self.evidence: list[tuple[str | None, tuple]] = []


def _literal_device(node: cst.CSTNode | None) -> str | None:
    """``"cuda:1"`` -> ``"cuda"`` for a device string literal, else None."""
    s = h.string_value(node)
    if s is None:
        return None
    m = _DEVICE_STR.match(s)
    return m.group(1) if m else None


class AutocastDeviceMismatch(Rule):
    """``torch.autocast`` given something that is not the device type of the tensors it should cast."""

    code = "AMP306"
    name = "autocast-device-mismatch"
    severity = Severity.WARNING
    message = _MISMATCH
    fix_title = "Pass the device type"
    fix_availability = "safe"
    words = (b"autocast",)
    summary = "`torch.autocast` device_type that is not the device type of the tensors (or not a type at all)."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.scopes: list[_Scope] = [_Scope(set())]
        # str(<parameter or attribute>) reports, kept until the file shows indexed devices
        self._unknown_str: list[tuple] = []

    # -- scope tracking ---------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        params = {p.name.value for p in (*node.params.posonly_params, *node.params.params,
                                         *node.params.kwonly_params)}
        for star in (node.params.star_arg, node.params.star_kwarg):
            if isinstance(star, cst.Param):
                params.add(star.name.value)
        self.scopes.append(_Scope(params))

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self.scopes.append(_Scope(set()))

    def leave_Lambda(self, node: cst.Lambda) -> None:
        self.scopes.pop()

    def leave_Assign(self, node: cst.Assign) -> None:
        scope = self.scopes[-1]
        kind = self._kind(node.value)
        for t in node.targets:
            if isinstance(t.target, cst.Name) and "device" in t.target.value.lower():
                scope.evidence.append((self._device_of_kind(kind), h.branch_path(self.ctx)))

    def leave_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None and isinstance(node.target, cst.Name):
            kind = self._kind(node.value)
            if "device" in node.target.value.lower():
                self.scopes[-1].evidence.append((self._device_of_kind(kind), h.branch_path(self.ctx)))

    def _kind(self, value: cst.BaseExpression) -> tuple[str, str | None]:
        if isinstance(value, cst.Call) and self.ctx.names.qualified(value.func) in _TORCH_DEVICE:
            first = h.arg(value, 0, "type")
            dev = _literal_device(first)
            if dev is not None and h.arg(value, 1, "index") is None:
                return "device", h.string_value(first)  # keep the index, if any, for str()
            return "torch.device", None
        dev = _literal_device(value)
        if dev is not None:
            return "str", dev
        return "other", None

    @staticmethod
    def _device_of_kind(kind: tuple[str, str | None]) -> str | None:
        if kind[0] in ("device", "str") and kind[1] is not None:
            return kind[1].split(":", 1)[0]
        return None

    def _known(self, name: str) -> list[tuple[str, str | None]] | None:
        """The kinds of the values ``name`` was bound to in this function before the current node:
        ("device", type) for ``torch.device("cuda:0")``, ("torch.device", None) for
        ``torch.device(<expr>)``, ("str", type) for a device string, ("other", None); None for a
        parameter or a name never bound here."""
        scope = self.scopes[-1]
        if name in scope.params:
            return None
        root = next((p for p in self.ctx.ancestors() if isinstance(p, (cst.FunctionDef, cst.Lambda))),
                    self.ctx.parents[0])
        if isinstance(root, cst.Lambda):
            return None
        before = flow_of(self.ctx, root).assignments_before(name, self.ctx.parents[-1])
        return [self._kind(a.value) if a.value is not None else ("other", None) for a in before] or None

    def _is_torch_device(self, expr: cst.BaseExpression) -> bool:
        """A name bound only to ``torch.device(...)`` in this function (statically clear)."""
        if isinstance(expr, cst.Call) and self.ctx.names.qualified(expr.func) in _TORCH_DEVICE:
            return True
        if not isinstance(expr, cst.Name):
            return False
        kinds = self._known(expr.value)
        return bool(kinds) and all(k[0] in ("device", "torch.device") for k in kinds)

    # -- placements -------------------------------------------------------------------
    def _placement(self, node: cst.Call) -> None:
        ev = self.scopes[-1].evidence
        branches = h.branch_path(self.ctx)
        mc = h.method_call(node, "to", "cuda")
        if mc is not None and mc[1] == "cuda":
            ev.append(("cuda", branches))
            return
        target = None
        if mc is not None:
            target = h.arg(node, None, "device")
            if target is None:
                first = h.arg(node, 0, None)
                if first is not None and h.dtype_of(self.ctx.names, first) is None and \
                        not any("dtype" in n for n in h.names_in(first)):
                    target = first
        else:
            target = h.arg(node, None, "device")
        if target is None:
            return
        dev = _literal_device(target)
        if dev == "cpu" and mc is not None and self._for_the_host(node):
            return  # `image = x.to("cpu")` then `image.numpy()`: a copy for the host, not where the model runs
        if dev is None and isinstance(target, cst.Name):
            kinds = self._known(target.value)
            if kinds:
                devs = {self._device_of_kind(k) for k in kinds}
                dev = devs.pop() if len(devs) == 1 else None
        ev.append((dev, branches))

    def _for_the_host(self, node: cst.Call) -> bool:
        """The moved tensor is bound to a name that the function turns into NumPy or Python data
        (`.numpy()`, `.tolist()`, `.item()`), or converted on the spot (`x.to("cpu").numpy()`)."""
        stack = self.ctx.parents
        parent = stack[-2] if len(stack) >= 2 else None
        if isinstance(parent, cst.Attribute) and parent.attr.value in _HOST:
            return True
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1
                and isinstance(parent.targets[0].target, cst.Name)):
            return False
        name = parent.targets[0].target.value
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, cst.FunctionDef)), None)
        if fn is None:
            return False
        return any(isinstance(n, cst.Attribute) and n.attr.value in _HOST and isinstance(n.value, cst.Name)
                   and n.value.value == name for n in h.walk(fn.body))

    # -- autocast calls ---------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        q = self.ctx.names.qualified(node.func)
        if q not in acs.AUTOCAST_GENERIC or (isinstance(node.func, cst.Name) and node.func.value in self.ctx.names.partials):
            self._placement(node)
            return
        dev_expr = h.arg(node, 0, "device_type")
        if dev_expr is None:
            return
        call = f"{source.short(node.func)}({source.short(dev_expr, 30)})"
        s = h.string_value(dev_expr)
        if s is not None:
            self._literal(node, dev_expr, s, call)
        elif isinstance(dev_expr, cst.FormattedString):
            head = dev_expr.parts[0] if dev_expr.parts else None
            if isinstance(head, cst.FormattedStringText):
                m = re.match(r"^(cpu|cuda|mps|xpu):", head.value)
                if m:
                    self._report(node, _INDEXED.format(arg=source.short(dev_expr, 30), fix=m.group(1)),
                                 dev_expr, edits.string(m.group(1)))
        elif isinstance(dev_expr, cst.Call) and isinstance(dev_expr.func, cst.Name) and \
                dev_expr.func.value == "str" and len(dev_expr.args) == 1 and \
                self.ctx.names.qualified(dev_expr.func) == "str":
            inner = dev_expr.args[0].value
            d = dotted_name(inner)
            if d is None or "device" not in d.rsplit(".", 1)[-1].lower():
                return
            if isinstance(inner, cst.Name):
                kinds = self._known(inner.value)
                if kinds and all(k[0] == "device" and k[1] is not None and ":" not in k[1] for k in kinds):
                    return  # torch.device("cuda"): str() gives "cuda", which is fine
                if kinds and all(k[0] == "str" for k in kinds):
                    return  # a device string: str() is a no-op
            rep = None
            if self._is_torch_device(inner):
                rep = cst.Attribute(value=inner, attr=cst.Name("type"))
            msg = _STR_DEVICE.format(arg=source.short(dev_expr, 30), dev=source.short(inner, 25))
            if not (isinstance(inner, cst.Name) and self._known(inner.value)):
                # a parameter or attribute: only wrong when the file makes indexed devices
                self._unknown_str.append((node, msg, dev_expr, rep))
                return
            self._report(node, msg, dev_expr, rep)
        elif self._is_torch_device(dev_expr):
            if isinstance(dev_expr, cst.Call):
                lit = h.string_value(h.arg(dev_expr, 0, "type"))
                dev = _literal_device(h.arg(dev_expr, 0, "type"))
                rep = edits.string(dev) if lit is not None and dev is not None else \
                    cst.Attribute(value=dev_expr, attr=cst.Name("type"))
            else:
                rep = cst.Attribute(value=dev_expr, attr=cst.Name("type"))
            self._report(node, _TORCH_DEVICE_MSG.format(call=call, fix=source.code(rep)), dev_expr, rep)

    def _literal(self, node: cst.Call, dev_expr: cst.BaseExpression, s: str, call: str) -> None:
        base = s.split(":", 1)[0]
        if s.strip().lower() in _NOT_A_DEVICE or (s != s.strip().lower() and s.strip().lower() in _DEVICE_TYPES):
            fix = "cuda" if s.strip().lower() in _NOT_A_DEVICE else s.strip().lower()
            self._report(node, _RAISES.format(call=call, arg=source.short(dev_expr), fix=f'"{fix}"'), dev_expr,
                         edits.string(fix))
            return
        if ":" in s and base in _DEVICE_TYPES and _DEVICE_STR.match(s):
            self._report(node, _INDEXED.format(arg=source.short(dev_expr), fix=base), dev_expr, edits.string(base))
            return
        if s not in _PLACEMENT:
            return
        ac = acs.autocast_call(self.ctx.names, node)
        if ac is not None and ac.enabled is False:
            return  # `autocast("cpu", enabled=False)` around CUDA code only switches it off
        here = h.branch_path(self.ctx)
        ev = [d for d, b in self.scopes[-1].evidence if not h.exclusive(b, here)]
        if not ev or None in ev:
            return
        devs = set(ev)
        if len(devs) != 1:
            return
        dev = devs.pop()
        if dev != s and dev in _PLACEMENT:
            self._report(node, _MISMATCH.format(ac=s, dev=dev), None, None)

    def leave_Module(self, node: cst.Module) -> None:
        if self._unknown_str and _makes_indexed_devices(node):
            for args in self._unknown_str:
                self._report(*args)

    def _report(self, node: cst.Call, msg: str, old: cst.CSTNode | None, new: cst.CSTNode | None) -> None:
        fix = None
        if old is not None and new is not None:
            fix = FixSpec(((old, new),), safe=True, title=self.fix_title)
        self.report(node, msg, fix)
