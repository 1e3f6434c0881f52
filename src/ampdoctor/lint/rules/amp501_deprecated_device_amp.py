from __future__ import annotations

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import edits
from ampdoctor.lint.semantic import source
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import FixSpec, Rule

# qualified name -> (replacement in torch.amp, device)
_DEPRECATED: dict[str, tuple[str, str]] = {}
for _dev in ("cuda", "cpu"):
    _DEPRECATED[f"torch.{_dev}.amp.autocast"] = ("autocast", _dev)
    _DEPRECATED[f"torch.{_dev}.amp.autocast_mode.autocast"] = ("autocast", _dev)
    _DEPRECATED[f"torch.{_dev}.amp.GradScaler"] = ("GradScaler", _dev)
    _DEPRECATED[f"torch.{_dev}.amp.grad_scaler.GradScaler"] = ("GradScaler", _dev)
for _k in ("custom_fwd", "custom_bwd"):
    _DEPRECATED[f"torch.cuda.amp.{_k}"] = (_k, "cuda")
    _DEPRECATED[f"torch.cuda.amp.autocast_mode.{_k}"] = (_k, "cuda")
_MODULES = {q.rsplit(".", 1)[0] for q in _DEPRECATED}

# the oldest torch with the device-generic replacement (rule-catalog row 30)
_NEEDS = {"autocast": (2, 3), "GradScaler": (2, 3), "custom_fwd": (2, 4), "custom_bwd": (2, 4)}
_AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")
_NEW_FORM = {
    "autocast": 'torch.amp.autocast("{d}", ...)',
    "GradScaler": 'torch.amp.GradScaler("{d}", ...)',
    "custom_fwd": 'torch.amp.custom_fwd(device_type="{d}")',
    "custom_bwd": 'torch.amp.custom_bwd(device_type="{d}")',
}
_ALIAS_FORM = {
    "autocast": '`functools.partial(torch.amp.autocast, "{d}")`',
    "GradScaler": '`functools.partial(torch.amp.GradScaler, "{d}")`',
    "custom_fwd": '`functools.partial(torch.amp.custom_fwd, device_type="{d}")`',
    "custom_bwd": '`functools.partial(torch.amp.custom_bwd, device_type="{d}")`',
}
_BINDING_PARENTS = (cst.Param, cst.FunctionDef, cst.ClassDef, cst.AssignTarget, cst.For, cst.AsName,
                    cst.NamedExpr, cst.AnnAssign, cst.AugAssign, cst.CompFor, cst.Global, cst.Nonlocal)


def _is_new_api(q: str) -> bool:
    return q.startswith("torch.amp.") or q in ("torch.autocast", "torch.GradScaler")


def _bound_value(stack: list[cst.CSTNode]) -> bool:
    """The node is what an assignment binds or a function returns, maybe as one branch of a
    conditional expression: ``amp_autocast = torch.cuda.amp.autocast``,
    ``ctx = torch.cuda.amp.autocast if amp else suppress``, ``return torch.cuda.amp.autocast``."""
    i = len(stack) - 2
    child = stack[-1]
    while i >= 0 and isinstance(stack[i], cst.IfExp) and child is not stack[i].test:
        child = stack[i]
        i -= 1
    return i >= 0 and isinstance(stack[i], (cst.Assign, cst.AnnAssign, cst.Return)) and stack[i].value is child


class _Unfixable(Exception):
    pass


class DeprecatedDeviceAmp(Rule):
    """``torch.cuda.amp.*`` / ``torch.cpu.amp.*`` autocast, GradScaler and custom_fwd/bwd."""

    code = "AMP501"
    name = "deprecated-device-amp"
    severity = Severity.INFO
    message = ("`{old}` is deprecated since torch 2.4 (it emits a FutureWarning). Use `{new}`{extra}.")
    alias_message = ("This name is bound to `{old}`, deprecated since torch 2.4: every call "
                     "through the name emits a FutureWarning. Bind {new} instead (keyword arguments: the "
                     "positional order differs).")
    import_message = ("`{old}` imports the device-specific AMP API, deprecated since torch 2.4: its uses "
                      "emit a FutureWarning. Use {new} instead.")
    fix_title = "Use `torch.amp` with an explicit device"
    fix_availability = "safe"
    words = (b"cuda.amp", b"cpu.amp", b"import amp")
    summary = "Deprecated `torch.cuda.amp`/`torch.cpu.amp` autocast, GradScaler and custom_fwd/custom_bwd."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # (ImportFrom, [(alias, local, kind, device)], the statement line holding it, its block)
        self.imports: list[tuple[cst.ImportFrom, list[tuple[cst.ImportAlias, str, str, str]], object, object]] = []

    # -- attribute chains: torch.cuda.amp.autocast(...), amp.GradScaler() ------------------
    def visit_Attribute(self, node: cst.Attribute) -> None:
        q = self.ctx.names.qualified(node)
        if q not in _DEPRECATED:
            return
        stack = self.ctx.parents
        parent = stack[-2] if len(stack) >= 2 else None
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return
        is_call = isinstance(parent, cst.Call) and parent.func is node
        is_decorator = isinstance(parent, cst.Decorator)
        grand = stack[-3] if len(stack) >= 3 else None
        is_partial = isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and \
            grand.args and grand.args[0] is parent and \
            self.ctx.names.qualified(grand.func) in ("functools.partial", "partial")
        is_bound = _bound_value(stack)
        if not (is_call or is_decorator or is_partial or is_bound):
            return  # a reference (a lookup table, isinstance, an annotation) does not warn
        if branches.in_version_guard(self.ctx) or branches.in_fallback(self.ctx, _is_new_api):
            return
        kind, dev = _DEPRECATED[q]
        torch_name, imports = edits.torch_local(self.ctx.names)
        fix = None
        if self._version_ok(kind):
            try:
                if is_call:
                    fix = FixSpec(((parent, self._new_call(parent, kind, dev, torch_name)),), safe=True,
                                  title=self.fix_title, imports=imports)
                elif is_decorator and kind in ("custom_fwd", "custom_bwd"):
                    fix = FixSpec(((node, self._bare_decorator(kind, dev, torch_name)),), safe=True,
                                  title=self.fix_title, imports=imports)
            except _Unfixable:
                fix = None
        extra = "; pass `enabled`/`dtype` by keyword, the positional order differs" if kind == "autocast" else ""
        if is_bound and not (is_call or is_decorator or is_partial):
            fix = None  # the alias's callers pass arguments in the old order: no mechanical rewrite
            msg = self.alias_message.format(old=source.short(node, 50), new=_ALIAS_FORM[kind].format(d=dev))
        else:
            msg = self.message.format(old=source.short(node, 50), new=_NEW_FORM[kind].format(d=dev), extra=extra)
        self.report(node, msg, fix)

    # -- from torch.cuda.amp import autocast, GradScaler -------------------------------------
    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or isinstance(node.names, cst.ImportStar):
            return
        module = dotted_name(node.module)
        if module not in _MODULES or branches.in_version_guard(self.ctx) or branches.in_fallback(self.ctx, _is_new_api):
            return
        found = []
        for alias in node.names:
            name = dotted_name(alias.name)
            q = f"{module}.{name}"
            if q in _DEPRECATED:
                local = alias.asname.name.value if alias.asname is not None and \
                    isinstance(alias.asname.name, cst.Name) else name
                found.append((alias, local, *_DEPRECATED[q]))
        if not found:
            return
        line = self.ctx.parents[-2] if len(self.ctx.parents) >= 2 else None
        block = self.ctx.parents[-3] if len(self.ctx.parents) >= 3 else None
        self.imports.append((node, found, line, block))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.imports:
            return
        refs = self._references(node, {local for _, found, _, _ in self.imports for _, local, _, _ in found})
        for imp, found, line, block in self.imports:
            news = sorted({_NEW_FORM[k].format(d=d) for _, _, k, d in found})
            msg = self.import_message.format(old=source.short(imp, 60), new=" and ".join(f"`{n}`" for n in news))
            fix = None
            try:
                fix = self._import_fix(imp, found, line, block, refs)
            except _Unfixable:
                fix = None
            self.report(imp, msg, fix)

    # -- fixes ----------------------------------------------------------------------------------
    def _version_ok(self, kind: str) -> bool:
        return self.ctx.min_torch is None or tuple(self.ctx.min_torch) >= _NEEDS[kind]

    def _new_call(self, call: cst.Call, kind: str, dev: str, torch_name: str) -> cst.Call:
        if acs.device_string_misplaced(self.ctx.names, call) is not None:
            raise _Unfixable  # a device string in the wrong place: AMP313 fixes the call
        func = edits.attr_chain(f"{torch_name}.amp.{kind}")
        args = list(call.args)
        if kind == "autocast":
            if any(a.star == "*" for a in args):
                raise _Unfixable
            out = []
            i = 0
            for a in args:
                if a.keyword is None and not a.star:
                    if i >= len(_AUTOCAST_POSITIONAL):
                        raise _Unfixable
                    a = a.with_changes(keyword=cst.Name(_AUTOCAST_POSITIONAL[i]),
                                       equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                             whitespace_after=cst.SimpleWhitespace("")))
                    i += 1
                out.append(a)
            new = _insert(out, 0, cst.Arg(edits.string(dev)), call)
        elif kind == "GradScaler":
            new = _insert(args, 0, cst.Arg(edits.string(dev)), call)
        else:
            if any(a.keyword is not None and a.keyword.value == "device_type" for a in args):
                raise _Unfixable
            at = next((i for i, a in enumerate(args) if a.keyword is not None or a.star == "**"), len(args))
            kw = cst.Arg(edits.string(dev), keyword=cst.Name("device_type"),
                         equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                               whitespace_after=cst.SimpleWhitespace("")))
            new = _insert(args, at, kw, call)
        return call.with_changes(func=func, args=new)

    def _bare_decorator(self, kind: str, dev: str, torch_name: str) -> cst.Call:
        return cst.Call(func=edits.attr_chain(f"{torch_name}.amp.{kind}"),
                        args=[cst.Arg(edits.string(dev), keyword=cst.Name("device_type"),
                                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                            whitespace_after=cst.SimpleWhitespace("")))])

    def _references(self, module: cst.Module, locals_: set[str]):
        """Every Name node spelling one of ``locals_``: (name, parent, grandparent, in annotation)."""
        out: list[tuple[cst.Name, cst.CSTNode, cst.CSTNode | None, bool]] = []

        def visit(n: cst.CSTNode, parent, grand, annot: bool) -> None:
            if isinstance(n, cst.Name) and n.value in locals_:
                out.append((n, parent, grand, annot))
            annot = annot or isinstance(n, cst.Annotation)
            for c in _tree.children(n):
                visit(c, n, parent, annot)

        visit(module, None, None, False)
        return out

    def _import_fix(self, imp: cst.ImportFrom, found, line, block, refs) -> FixSpec:
        if any(not self._version_ok(kind) for _, _, kind, _ in found):
            raise _Unfixable
        torch_name, imports = edits.torch_local(self.ctx.names)
        by_local = {local: (kind, dev) for _, local, kind, dev in found}
        own = {id(a) for a, _, _, _ in found}
        changes: list[tuple[cst.CSTNode, object]] = []
        for name, parent, grand, annot in refs:
            if name.value not in by_local:
                continue
            kind, dev = by_local[name.value]
            if isinstance(parent, cst.ImportAlias):
                if id(parent) in own:
                    continue
                raise _Unfixable  # the name is bound by another import too
            if isinstance(parent, cst.Attribute) and parent.attr is name:
                continue  # obj.autocast: another name
            if isinstance(parent, cst.Arg) and parent.keyword is name:
                continue  # f(autocast=...)
            if isinstance(parent, _BINDING_PARENTS) and not isinstance(parent, cst.AnnAssign):
                raise _Unfixable  # rebound somewhere: a rename could change another binding
            if isinstance(parent, cst.AnnAssign) and parent.target is name:
                raise _Unfixable
            if isinstance(parent, cst.Call) and parent.func is name:
                changes.append((parent, self._new_call(parent, kind, dev, torch_name)))
            elif isinstance(parent, cst.Decorator) and kind in ("custom_fwd", "custom_bwd"):
                changes.append((name, self._bare_decorator(kind, dev, torch_name)))
            elif kind == "GradScaler" and (annot or (isinstance(parent, cst.Arg) and isinstance(grand, cst.Call)
                                                     and dotted_name(grand.func) in ("isinstance", "issubclass"))):
                changes.append((name, edits.attr_chain(f"{torch_name}.amp.GradScaler")))
            else:
                raise _Unfixable  # e.g. `ctx = autocast if amp else nullcontext`: no device to add
        keep = [a for a in imp.names if id(a) not in own]
        if keep:
            last = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            changes.append((imp, imp.with_changes(names=[*keep[:-1], last])))
        elif isinstance(line, cst.SimpleStatementLine) and len(line.body) > 1:
            changes.append((imp, cst.RemoveFromParent()))
        elif isinstance(line, cst.SimpleStatementLine) and len(getattr(block, "body", ())) > 1:
            changes.append((line, cst.RemoveFromParent()))
        elif isinstance(line, cst.SimpleStatementLine):
            changes.append((line, line.with_changes(body=[cst.Pass()])))
        else:
            raise _Unfixable
        return FixSpec(tuple(changes), safe=True, title=self.fix_title, imports=imports)  # type: ignore[arg-type]


def _insert(args: list[cst.Arg], at: int, new: cst.Arg, call: cst.Call) -> list[cst.Arg]:
    """``args`` with ``new`` inserted at ``at``, keeping the call's layout (one arg per line stays so)."""
    args = list(args)
    if not args:
        return [new]
    if at < len(args):
        sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        first_comma = args[0].comma
        ws = call.whitespace_before_args
        if at == 0 and isinstance(first_comma, cst.Comma) and \
                isinstance(first_comma.whitespace_after, cst.ParenthesizedWhitespace):
            # one argument per line: the new one gets its own line, without the comment
            pw = first_comma.whitespace_after
            sep = cst.Comma(whitespace_after=pw.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[]))
        elif at == 0 and isinstance(ws, cst.ParenthesizedWhitespace):
            sep = cst.Comma(whitespace_after=ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[]))
        args.insert(at, new.with_changes(comma=sep))
        return args
    prev = args[-1]
    if not isinstance(prev.comma, cst.Comma):
        args[-1] = prev.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(new)
    else:
        args.append(new.with_changes(comma=cst.MaybeSentinel.DEFAULT))
    return args
