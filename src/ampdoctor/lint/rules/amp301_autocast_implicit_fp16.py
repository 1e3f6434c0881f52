from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic.backward import is_backward_call
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import casts as conv
from ampdoctor.lint.semantic import vocabulary as voc

# names of settings that choose the training precision
_SETTING = re.compile(r"^(dtype|ptdtype|dtype_str|precision|mixed_precision|amp_precision|amp_dtype|autocast_dtype|"
                      r"compute_dtype|train_dtype|training_dtype)$")
_KEYWORDS = {"dtype", "precision", "mixed_precision", "amp_dtype", "autocast_dtype", "compute_dtype",
             "train_dtype", "training_dtype"}
# calls whose dtype keyword makes a tensor, not a setting
_TENSOR_CALLS = re.compile(r"^(to|type|view|astype|cast|tensor|as_tensor|zeros|ones|empty|full|rand\w*|arange|"
                           r"linspace|logspace|eye|new_\w+|\w+_like|from_numpy|from_pretrained|load|"
                           r"set_default_dtype|autocast|get_autocast_dtype|finfo|iinfo)$")
_CONFIG_CLASS = re.compile(r"(Config|Args|Arguments|Settings|Params|Options|Hparams|HParams|Cfg)$")
_SET_AUTOCAST_DTYPE = {"torch.set_autocast_gpu_dtype", "torch.set_autocast_dtype", "torch.set_autocast_xpu_dtype"}


@dataclass
class _Config:
    text: str
    top: int | None  # id of the module-level statement holding it; None when file-wide


class AutocastImplicitFp16(Rule):
    """A CUDA autocast without dtype in a program configured for bfloat16."""

    code = "AMP301"
    name = "autocast-implicit-fp16"
    severity = Severity.ERROR
    message = ("This CUDA autocast has no `dtype`, so it computes in float16 although the file uses bfloat16: "
               "the file configures bfloat16 ({cfg}) and that setting never reaches it. Pass the configured dtype: "
               "`dtype=torch.bfloat16` or the dtype variable.")
    fix_availability = "suggestion"
    words = (b"bfloat16", b"bf16")
    also = (b"autocast",)
    summary = "CUDA autocast without `dtype=` (so float16) in a file that configures bfloat16."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.configs: list[_Config] = []
        self.placement: dict[int, int | None] = {}  # id(autocast call) -> its placement
        self.sets_default = False
        self.flow = u.AutocastFlow()
        self.arm: dict[int, str] = {}  # id(autocast call) -> the bf16-only branch it sits in

    # -- where ------------------------------------------------------------------------

    def _placement(self) -> int | None:
        """None for module level or the body of a configuration class (file-wide), else the id
        of the module-level statement (a def, a class) that holds the current node."""
        local = False
        for p in self.ctx.ancestors():
            if isinstance(p, (cst.FunctionDef, cst.Lambda)):
                local = True
            elif isinstance(p, cst.ClassDef) and not _CONFIG_CLASS.search(p.name.value) and not any(
                    "dataclass" in (dotted_name(d.decorator) or dotted_name(getattr(d.decorator, "func", None)) or "")
                    for d in p.decorators):
                local = True
        if local:
            top = u.top_level_statement(self.ctx)
            return id(top) if top is not None else None
        return None

    def _config(self, text: str) -> None:
        self.configs.append(_Config(" ".join(text.split()), self._placement()))

    # -- settings ---------------------------------------------------------------------

    def _setting_value(self, target: cst.CSTNode, value: cst.CSTNode | None) -> None:
        d = dotted_name(target)
        if d is None or value is None:
            return
        last = d.rsplit(".", 1)[-1].lower()
        if _SETTING.search(last) and "bfloat16" in conv.possible_dtypes(self.ctx.names, value) \
                or voc.is_bf16_flag(target) and u.is_literal(value, True):
            sep = "=" if isinstance(target, cst.Name) and isinstance(self.ctx.parents[-1], cst.Param) else " = "
            self._config(f"`{d}{sep}{u.short(value, 40)}`")

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._setting_value(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._setting_value(node.target, node.value)

    def visit_Param(self, node: cst.Param) -> None:
        if node.default is not None:
            self._setting_value(node.name, node.default)

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        q = names.qualified(node.func) or ""
        ac = acs.autocast_call(names, node)
        if ac is not None:
            if self._implicit_fp16(ac):
                self.placement[id(node)] = self._placement()
                self.flow.autocast(self.ctx, node)
            return
        if is_backward_call(self.ctx.names, node):
            self.flow.backward_call(self.ctx, node)
            return
        if q in _SET_AUTOCAST_DTYPE:
            self.sets_default = True
            return
        mc = h.method_call(node, "add_argument")
        if mc is not None:
            self._argument(node)
            return
        mc = h.method_call(node, "to", "bfloat16")
        if mc is not None and not u.in_precision_branch(self.ctx) and (mc[1] == "bfloat16" and not node.args or
                               mc[1] == "to" and any(h.dtype_of(names, a.value) == "bfloat16" for a in node.args)):
            self._config(f"`{u.short(node, 40)}`")  # a model or its inputs moved to bfloat16
            return
        last = q.rsplit(".", 1)[-1] if q else ""
        if q.startswith(("torch.", "numpy.", "np.", "jax.", "jnp.")) or _TENSOR_CALLS.match(last):
            return
        for a in node.args:
            if a.keyword is None:
                continue
            k = a.keyword.value
            if k in _KEYWORDS and "bfloat16" in conv.possible_dtypes(names, a.value) \
                    or voc.is_bf16_flag(a.keyword) and u.is_literal(a.value, True):
                self._config(f"`{k}={u.short(a.value, 40)}`")

    def _argument(self, call: cst.Call) -> None:
        """``parser.add_argument("--dtype", default="bfloat16")`` or ``("--bf16", action="store_true")``."""
        raw = [h.string_value(a.value) for a in call.args if a.keyword is None]
        raw = [o for o in raw if o and o.startswith("-")]
        opts = [o.lstrip("-").replace("-", "_").lower() for o in raw]
        if not opts:
            return
        default = h.arg(call, None, "default")
        if any(_SETTING.search(o) for o in opts):
            if "bfloat16" in conv.possible_dtypes(self.ctx.names, default):
                self._config(f"`{raw[-1]}` defaults to `{u.short(default, 30)}`")
        elif any(voc.is_bf16_flag(cst.Name(o)) for o in opts if o.isidentifier()):
            self._config(f"the `{raw[-1]}` option")

    # -- the autocast -----------------------------------------------------------------

    def visit_With(self, node: cst.With) -> None:
        self.flow.with_statement(self.ctx, node)

    def _implicit_fp16(self, ac: acs.Autocast) -> bool:
        if ac.dtype_expr is not None or ac.enabled is False or h.has_star_args(ac.call):
            return False
        if h.in_compat_guard(self.ctx):
            return False  # an old-torch fallback
        if ac.device is not None and ac.device != "cuda":
            return False
        if ac.device is None:
            # a device variable: fp16 on CUDA, but only a plain name/attribute is a device choice
            dev = h.arg(ac.call, 0, "device_type")
            if dev is None or not isinstance(dev, (cst.Name, cst.Attribute)):
                return False
        en = h.arg(ac.call, 0 if ac.qualified in acs.AUTOCAST_CUDA else 2, "enabled")
        if en is not None and not u.enables_for_bf16(self.ctx.names, en) and u.test_mentions(self.ctx.names, en):
            return False  # `enabled=args.fp16`: it only runs for fp16
        arm = branches.bf16_arm(self.ctx)
        if arm is not None:  # `if args.bf16: with torch.autocast("cuda"):` runs float16 exactly when bf16 is asked
            self.arm[id(ac.call)] = f"the `if {u.short(arm, 40)}:` branch it sits in"
            return True
        return not u.in_precision_branch(self.ctx)

    def leave_Module(self, node: cst.Module) -> None:
        if self.sets_default or not (self.configs or self.arm):
            return
        # only autocasts that compute the forward of a training step: the consequence there is
        # fp16 gradients (underflow, or a scaler that the bf16 setting turned off)
        for _block, _scope, call in self.flow.feeding(self.ctx.names):
            top = self.placement[id(call)]
            # prefer a setting next to the autocast, then a file-wide one
            near = [c for c in self.configs if c.top is not None and c.top == top]
            cfg = (near or [c for c in self.configs if c.top is None] or [None])[0]
            text = self.arm.get(id(call)) or (cfg.text if cfg is not None else None)
            if text is None:
                continue
            self.report(call, self.message.format(cfg=text))
