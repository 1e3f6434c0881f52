"""Name heuristics shared by every rule: what an identifier says about precision, and which
receivers are optimizers or gradient scalers."""

from __future__ import annotations

import re

import libcst as cst

from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.project import test_path

# identifier words that name a precision setting (``use_bf16``, ``amp_dtype``, ``mixed_precision``)
PRECISION_WORDS = frozenset({"bf16", "bfloat16", "bfloat", "fp16", "float16", "half", "amp", "autocast",
                             "precision", "dtype", "tf32", "mixed", "fp32", "float32", "gradscaler", "scaler"})
# substrings of a branch test that make it a precision switch (``if args.fp16:``, ``dtype == ...``)
PRECISION_SUBSTRINGS = ("16", "half", "dtype", "precision", "bf", "fp", "float", "scal", "amp_mode")
GRAD_SCALERS = ("GradScaler", "ShardedGradScaler")

_BF16_FLAG = re.compile(r"^(use_|is_|enable_|with_|do_)?(bf16|bfloat16)(_enabled|_mode|_training|_amp|_run|_train)?$")
_OPT_RE = re.compile(r"(.*_)?opts?(_.*|\d+|[a-z])?")


def words(text: str) -> list[str]:
    """``safe_bf16_supported`` -> ["safe", "bf16", "supported"]; camelCase is split too."""
    text = re.sub(r"([a-z])([A-Z])", r"\1_\2", text)
    return [w for w in re.split(r"[^0-9a-zA-Z]+", text.lower()) if w]


def is_grad_scaler_name(qualified: str | None) -> bool:
    return bool(qualified) and qualified.rsplit(".", 1)[-1] in GRAD_SCALERS  # type: ignore[union-attr]


def is_scaler(names: Names, expr: cst.BaseExpression) -> bool:
    """A receiver that holds a GradScaler: made by ``GradScaler(...)`` or named like one, but not
    an instance of another ``*Scaler`` class (fairscale's ``LayerwiseGradientScaler``, timm's
    ``NativeScaler``, DeepSpeed's ``DynamicLossScaler``: other protocols)."""
    made = names.made_by(expr)
    if is_grad_scaler_name(made):
        return True
    if made and made.rsplit(".", 1)[-1].endswith("Scaler"):
        return False
    d = dotted_name(expr)
    if d is None:
        return False
    return "scaler" in d.rsplit(".", 1)[-1].lower()


def is_scaler_wrapper_name(qualified: str | None) -> bool:
    """timm's ``NativeScaler`` and MAE's ``NativeScalerWithGradNormCount``: a callable that owns a
    GradScaler (``loss_scaler(loss, optimizer)`` scales, steps and updates it) and exposes its
    ``state_dict()``; its protocol is not the GradScaler's, but its state is."""
    return bool(qualified) and "NativeScaler" in qualified.rsplit(".", 1)[-1]  # type: ignore[union-attr]


def holds_scaler_state(names: Names, expr: cst.BaseExpression) -> bool:
    """A receiver whose ``state_dict()`` is a loss scaler's: a GradScaler or a wrapper of one."""
    return is_scaler(names, expr) or is_scaler_wrapper_name(names.made_by(expr))


def scaled_by(names: Names, node: cst.CSTNode) -> str | None:
    """For ``S.scale(x)`` on a GradScaler receiver: the dotted name of ``S`` ("scaler" when it has
    none), else None."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "scale" \
            and is_scaler(names, node.func.value):
        return dotted_name(node.func.value) or "scaler"
    return None


def is_optimizer(names: Names, expr: cst.CSTNode) -> bool:
    """A receiver that is an optimizer: ``opt``, ``self.optimizer``, ``optimizers[0]``, ``opt_g``,
    or a name assigned from ``torch.optim.*``; never a scheduler, scaler or wrapper."""
    if isinstance(expr, cst.Subscript):
        expr = expr.value
    if is_scaler(names, expr):  # type: ignore[arg-type]
        return False
    made = names.made_by(expr) or ""
    if made.startswith("torch.optim.") and "lr_scheduler" not in made:
        return True
    d = dotted_name(expr)
    if d is None:
        return False
    last = d.rsplit(".", 1)[-1].lower()
    if any(w in last for w in ("sched", "scaler", "lr", "wrapper", "swa", "ema")):
        return False
    return "optim" in last or bool(_OPT_RE.fullmatch(last))


def is_bf16_flag(node: cst.CSTNode) -> bool:
    """A name or attribute that is a bfloat16 switch: ``bf16``, ``args.use_bf16``, ``bf16_enabled``."""
    d = dotted_name(node)
    return d is not None and bool(_BF16_FLAG.match(d.rsplit(".", 1)[-1].lower()))


def in_test(ctx) -> bool:
    """The current node is test code: inside a ``test*`` function or a ``Test*`` class, or in a
    ``test_*.py``/``*_test.py`` file or a ``tests``/``test`` folder. Tests set odd AMP configurations on purpose (a tiny loss
    scale, a hand cast inside autocast) to exercise them."""
    if test_path(ctx.path):
        return True
    for p in ctx.ancestors():
        if isinstance(p, cst.FunctionDef) and p.name.value.startswith("test"):
            return True
        if isinstance(p, cst.ClassDef) and p.name.value.startswith("Test"):
            return True
    return False
