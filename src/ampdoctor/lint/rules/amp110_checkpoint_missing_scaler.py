from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.flow import flow_of

_SAVE = {"torch.save", "torch.serialization.save"}
_SCALER_METHODS = ("scale", "unscale_", "step", "update")
_SAVE_HELPERS = {"save_checkpoint", "save_ckpt", "save_on_master", "save_model_checkpoint", "checkpoint_save",
                 "save_training_state", "save_state_dict"}
_SAVING_OBJECTS = ("accelerator", "fabric", "xm")  # their .save(obj, path) is torch.save


def _save_helper(q: str) -> bool:
    """A call that may write a checkpoint: `save_checkpoint`, `save_model`, `utils.save_on_master`,
    `accelerator.save` (what it is given decides: a dict with the optimizer state, or an optimizer)."""
    parts = q.split(".")
    last = parts[-1].lower()
    if last in _SAVE_HELPERS or last.startswith("save_") or last.endswith("_save"):
        return "load" not in last
    return last == "save" and len(parts) >= 2 and parts[-2].lower() in _SAVING_OBJECTS


def _mentions_scaler(names, expr: cst.BaseExpression) -> bool:
    return any(voc.holds_scaler_state(names, n) for n in [expr, *h.walk(expr)] if isinstance(n, (cst.Name, cst.Attribute)))


_MUTATORS = ("update", "setdefault", "__setitem__", "pop", "clear")
_ADDING = ("update", "setdefault", "__setitem__")  # the mutators that can put an entry in


def _may_add_scaler(names, key: cst.BaseExpression | None, value: cst.BaseExpression | None) -> bool:
    """An entry written into a checkpoint dict may be the scaler's state: its key is not a literal
    string (or one that names a scaler) or its value involves a scaler. ``ckpt["ema"] =
    ema.state_dict()`` cannot be."""
    k = h.string_value(key) if key is not None else None
    if k is None or "scal" in k.lower():
        return True
    return value is not None and _mentions_scaler(names, value)


def _update_may_add_scaler(names, call: cst.Call) -> bool:
    """``ckpt.update(...)``/``ckpt.setdefault(...)``/``ckpt.__setitem__(...)`` may add the scaler's
    state (``update({"ema": ...})`` and ``update(ema=...)`` with other keys cannot)."""
    meth = call.func.attr.value if isinstance(call.func, cst.Attribute) else ""
    if meth in ("setdefault", "__setitem__"):
        args = [a.value for a in call.args]
        return _may_add_scaler(names, args[0] if args else None, args[1] if len(args) > 1 else None)
    for a in call.args:
        if a.keyword is not None:
            if _may_add_scaler(names, cst.SimpleString(f'"{a.keyword.value}"'), a.value):
                return True
        elif isinstance(a.value, cst.Dict) and not a.star:
            for el in a.value.elements:
                if not isinstance(el, cst.DictElement) or _may_add_scaler(names, el.key, el.value):
                    return True
        else:
            return True
    return False


@dataclass
class _Save:
    call: cst.Call
    scope: int
    arg: cst.BaseExpression
    order: int
    func_id: int  # id of the enclosing def, 0 at module level
    function: cst.FunctionDef | None  # the enclosing def
    klass: int | None  # id of the enclosing class
    optimizer_given: bool = False  # a save helper receives the optimizer itself, not a dict


def _where(ctx) -> tuple[int, cst.FunctionDef | None, int | None]:
    """(id of the innermost def or 0, that def, id of the innermost class or None)."""
    func = None
    klass = None
    for p in ctx.ancestors():
        if isinstance(p, cst.FunctionDef) and func is None:
            func = p
        elif isinstance(p, cst.ClassDef) and klass is None:
            klass = p
    return (id(func) if func else 0), func, (id(klass) if klass else None)


class CheckpointMissingScaler(Rule):
    """A training checkpoint that stores the optimizer state but not the GradScaler's."""

    code = "AMP110"
    name = "checkpoint-missing-scaler"
    severity = Severity.WARNING
    message = ("This checkpoint stores the optimizer state but not the GradScaler's: a resumed run "
               "restarts the loss scale at its initial value and skips steps until it backs off again. "
               "Add `\"scaler\": {s}.state_dict()` and restore it with `{s}.load_state_dict(...)`.")
    conditional_message = ("This checkpoint stores the optimizer state but not the GradScaler's: the scaler "
                           "is enabled when `{cond}`, and a run resumed in that mode restarts the loss scale at its "
                           "initial value and skips steps until it backs off again. Add `\"scaler\": "
                           "{s}.state_dict()` and restore it with `{s}.load_state_dict(...)`.")
    fix_availability = "suggestion"
    words = (b"scaler", b"Scaler")
    summary = "`torch.save` of a training checkpoint with the optimizer state but no GradScaler state."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.uses_scaler = False
        # where a scaler's state_dict() is taken (saved separately, or added to the dict later)
        self.saved_defs: set[int] = set()
        self.saved_classes: set[int] = set()
        self.scaler_names: list[str] = []
        self.saves: list[_Save] = []
        # (scope id, name) of dicts changed in place (`ckpt["scaler"] = ...`, `ckpt.update(...)`)
        self.mutated: set[tuple[int, str]] = set()
        self._synth: dict[int, cst.Dict] = {}  # id(call) -> the dict literal its keywords make
        self.order = 0
        # where the scaler lives: defs, classes, module level
        self.scaler_defs: set[int] = set()
        self.scaler_classes: set[int] = set()
        # where the file restores an optimizer (its resume paths): only then does a lost scale
        # matter, and only if one of them can run
        self.restores: list[cst.Call] = []
        self.made_in: list = []  # per GradScaler construction: the def whose local it is, else None
        # the `enabled=` condition of each scaler built here (None: always on)
        self.conditions: list[str | None] = []

    def _scope(self) -> int:
        s = h.enclosing_scope(self.ctx)
        return id(s) if s is not None else 0

    # -- collection -------------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        names = self.ctx.names
        scope, _, klass = _where(self.ctx)
        if u.is_grad_scaler_ctor(names, node) or voc.is_scaler_wrapper_name(names.qualified(node.func)):
            if not u.scaler_off(names, node):
                # the mode that enables it: `enabled=args.fp16`, or the `if` it is made under
                en = u.scaler_enabled(names, node)
                if en is None:
                    en = u.precision_guard(self.ctx)
                precision = en is not None and u.precision_test(names, en)
                self.conditions.append(u.short(en, 40) if precision else None)  # a precision mode, not the device
                t = u.scaler_target(self.ctx)
                self._scaler_here(scope, klass, t)
                _, fn, _ = _where(self.ctx)
                # a local scaler of a function (not `self.scaler`): it lives as long as one call
                self.made_in.append(fn if t and "." not in t else None)
                if t and t not in self.scaler_names:
                    self.scaler_names.append(t)
            return
        if self._restores_optimizer(node):
            self.restores.append(node)
        mc = h.method_call(node, "state_dict", *_SCALER_METHODS, *_MUTATORS)
        if mc is not None:
            recv, meth = mc
            if meth in _MUTATORS:
                d = dotted_name(recv)
                if d is not None and meth in _ADDING and _update_may_add_scaler(names, node):
                    self.mutated.add((self._scope(), d))
            elif voc.holds_scaler_state(names, recv):
                if meth == "state_dict":
                    self.saved_defs.add(scope)
                    if klass is not None:
                        self.saved_classes.add(klass)
                else:
                    self._scaler_here(scope, klass, dotted_name(recv))
            return
        q = names.qualified(node.func) or ""
        if q in _SAVE and node.args and node.args[0].keyword is None:
            _, fn, _ = _where(self.ctx)
            first = node.args[0].value
            sd = h.method_call(first, "state_dict")
            if sd is not None and voc.is_optimizer(names, sd[0]):
                # `torch.save(optimizer.state_dict(), "optimizer.pt")`: files per object, and
                # no `scaler.pt` beside it (a `scaler.state_dict()` in the same def or class is)
                self.saves.append(_Save(node, self._scope(), first, self.order, scope, fn, klass, True))
            else:
                self.saves.append(_Save(node, self._scope(), first, self.order, scope, fn, klass))
        elif _save_helper(q) and any(_mentions_scaler(names, a.value) for a in node.args):
            # `save_accelerator_state(dir, weights, optimizers, schedulers, rank, self.scaler)`: this
            # code saves the scaler's state too, through the helper
            self.saved_defs.add(scope)
            if klass is not None:
                self.saved_classes.add(klass)
        elif _save_helper(q) and not self._defined_here(q):
            # `save_checkpoint(ckpt, is_best, dir)`, `utils.save_on_master(state, path)`,
            # `accelerator.save(state, path)`, `save_model(..., states={...})`: a helper (often in
            # another file) that writes a dict; `save_checkpoint(net, optim, lr, epoch, path)`
            # one that builds it from the optimizer it is given
            _, fn, _ = _where(self.ctx)
            for a in node.args:
                if a.star:
                    continue
                if voc.is_optimizer(names, a.value):
                    self.saves.append(_Save(node, self._scope(), a.value, self.order, scope, fn, klass, True))
                else:
                    self.saves.append(_Save(node, self._scope(), a.value, self.order, scope, fn, klass))

    def _restores_optimizer(self, node: cst.Call) -> bool:
        """`optimizer.load_state_dict(...)`, or a load/resume helper given the optimizer
        (`load_checkpoint(path, net, optim)`, `smart_resume(ckpt, optimizer, ...)`)."""
        names = self.ctx.names
        mc = h.method_call(node, "load_state_dict")
        if mc is not None:
            recv = mc[0]
            d = (dotted_name(recv) or "").lower()
            return voc.is_optimizer(names, recv) or "optim" in d or "opt" == d.rsplit(".", 1)[-1]
        q = (names.qualified(node.func) or dotted_name(node.func) or "").rsplit(".", 1)[-1].lower()
        if "load" in q or "resume" in q or "restore" in q:
            return any(voc.is_optimizer(names, a.value) for a in node.args if not a.star)
        return False

    def _defined_here(self, q: str) -> bool:
        """A helper defined in this file: its own `torch.save` is judged where it is."""
        last = q.rsplit(".", 1)[-1]
        return any(f.name == last for f in facts_of(self.ctx).calls.functions.values())

    def _scaler_here(self, scope: int, klass: int | None, name: str | None) -> None:
        self.uses_scaler = True
        self.scaler_defs.add(scope)
        if klass is not None and name is not None and name.startswith(("self.", "cls.")):
            self.scaler_classes.add(klass)  # an attribute: every method can reach it

    def _related(self, save: _Save) -> bool:
        """The save belongs to the program that uses the scaler: same def or class, a scaler at
        module level, or a def that a scaler-using def calls (`save_checkpoint(...)`)."""
        if 0 in self.scaler_defs or save.klass is not None and save.klass in self.scaler_classes:
            return True
        if save.func_id in self.scaler_defs:
            return True
        fn = facts_of(self.ctx).calls.function(save.function) if save.function is not None else None
        # a helper called from a def that uses the scaler, or from a method of a class that holds it
        return fn is not None and any(
            site.caller is not None and (id(site.caller.node) in self.scaler_defs or
                                         site.caller.cls is not None and id(site.caller.cls.node) in self.scaler_classes)
            for site in fn.sites)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._subscript(t.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._subscript(node.target, node.value)

    def _subscript(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """``ckpt["scaler"] = ...``: that dict may be completed in place (``ckpt["ema"] =
        ema.state_dict()`` cannot complete it)."""
        if isinstance(target, cst.Subscript):
            d = dotted_name(target.value)
            key = target.slice[0].slice if len(target.slice) == 1 else None
            key = key.value if isinstance(key, cst.Index) else None
            if d is not None and _may_add_scaler(self.ctx.names, key, value):
                self.mutated.add((self._scope(), d))

    # -- decision ---------------------------------------------------------------------

    def leave_Module(self, node: cst.Module) -> None:
        if not self.uses_scaler or 0 in self.saved_defs or not self.restores:
            return  # no resume path restores the optimizer here: the checkpoints are not resumed from
        if facts_of(self.ctx).evidence.bf16_autocast_only:
            return  # every autocast is bfloat16: the scaler's state is worth nothing on resume
        graph = facts_of(self.ctx).calls
        if self.made_in and all(fn is not None and graph.run_anew(fn) is not None for fn in self.made_in):
            return  # each scaler is made anew by a function called in a loop (AMP107): its state never outlives a call
        s = self.scaler_names[0] if len(self.scaler_names) == 1 else "scaler"
        seen: set[int] = set()
        # def -> its first checkpoint without the scaler, that checkpoint's optimizer, and how many
        # more checkpoints of the same optimizer it writes (one report: a second one on the same
        # function reads as a duplicate). The checkpoint of another optimizer in the same def (G
        # and D, one scaler) needs no mention: saving the scaler once restores it.
        first: dict[int, tuple[_Save, str]] = {}
        more: dict[int, int] = {}
        helpers: set[tuple[int, str]] = set()
        for save in self.saves:
            d = save.call if save.optimizer_given else self._dict_of(save)
            if d is None or id(d) in seen:
                continue  # one report per checkpoint, not per `torch.save` of it (last, best, ...)
            if not save.optimizer_given and (not self._has_optimizer(d) or self._has_scaler(d)):
                continue
            if not self._related(save):
                continue
            if save.func_id in self.saved_defs or save.klass is not None and save.klass in self.saved_classes:
                continue  # the scaler state is saved next to it
            seen.add(id(d))
            q = self.ctx.names.qualified(save.call.func) or dotted_name(save.call.func) or ""
            if q not in _SAVE:  # `save_model(epoch, model, dir, optimizer)` twice in a def: one fix, in the helper
                if (save.func_id, q) in helpers:
                    continue
                helpers.add((save.func_id, q))
            opt = self._optimizer_text(save, d)
            if save.func_id not in first:
                first[save.func_id] = (save, opt)
            elif first[save.func_id][1] == opt:
                more[save.func_id] = more.get(save.func_id, 0) + 1
        conds = set(self.conditions)
        for func_id, (save, _) in first.items():
            if len(conds) == 1 and None not in conds:
                msg = self.conditional_message.format(s=s, cond=next(iter(conds)))
            else:
                msg = self.message.format(s=s)
            n = more.get(func_id, 0)
            if n:
                msg += (f" The {n} other checkpoint{'s' if n > 1 else ''} this "
                        f"{'function' if func_id else 'script'} writes lack{'' if n > 1 else 's'} it too.")
            self.report(save.call, msg, premises=self.restores)

    def _dict_of(self, save: _Save) -> cst.Dict | None:
        return self._as_dict(save.arg, save, 0)

    def _as_dict(self, expr: cst.BaseExpression, save: _Save, depth: int) -> cst.Dict | None:
        """The checkpoint as a dict literal: the literal itself, ``dict(k=v, ...)``,
        ``asdict(Snapshot(k=v, ...))`` (keywords become keys), or what a local name is bound to."""
        if isinstance(expr, cst.Dict):
            return expr
        if isinstance(expr, cst.Call) and depth < 3:
            q = self.ctx.names.qualified(expr.func) or ""
            if q in ("dict", "builtins.dict"):
                return self._keywords(expr)
            if q.rsplit(".", 1)[-1] in ("asdict", "vars") and len(expr.args) == 1:
                inner = expr.args[0].value
                if isinstance(inner, cst.Call):
                    return self._keywords(inner)
                return self._as_dict(inner, save, depth + 1)
            last = q.rsplit(".", 1)[-1]
            if last[:1].isupper() and expr.args and all(a.keyword is not None or a.star == "**" for a in expr.args):
                return self._keywords(expr)  # a dataclass / NamedTuple snapshot built by keywords
            return None
        name = dotted_name(expr)
        if name is None or (save.scope, name) in self.mutated:
            return None
        root = save.function if save.function is not None else self.ctx.parents[0]
        flow = flow_of(self.ctx, root)
        # the one binding that reaches the save (a checkpoint loaded earlier under the same name
        # is common); none after it, which could flow back around a loop
        at = flow.pos(save.call)
        if any(a.order > at for a in flow.assigns.get(name, [])):
            return None
        reaching = flow.reaching(name, save.call)
        if len(reaching) != 1 or reaching[0].value is None:
            return None
        value = reaching[0].value
        return value if isinstance(value, cst.Dict) else self._as_dict(value, save, depth + 1)

    def _keywords(self, call: cst.Call) -> cst.Dict | None:
        """``f(a=x, **rest)`` as the dict literal ``{"a": x, **rest}`` (one per call: reports dedupe by it)."""
        hit = self._synth.get(id(call))
        if hit is not None:
            return hit
        if any(a.keyword is None and a.star != "**" for a in call.args):
            return None  # positional fields: their names are not known here
        els: list = []
        for a in call.args:
            if a.star == "**":
                els.append(cst.StarredDictElement(a.value))
            else:
                els.append(cst.DictElement(cst.SimpleString(f'"{a.keyword.value}"'), a.value))  # type: ignore[union-attr]
        d = self._synth[id(call)] = cst.Dict(els)
        return d

    def _optimizer_text(self, save: _Save, d) -> str:
        """The optimizer a checkpoint holds, as written (`self.optimizer_g`), else ""."""
        if save.optimizer_given:
            return dotted_name(save.arg) or ""
        for el in d.elements:
            if isinstance(el, cst.DictElement) and isinstance(el.value, cst.Call):
                mc = h.method_call(el.value, "state_dict")
                key = (h.string_value(el.key) or "").lower()
                if mc is not None and ("optim" in key or voc.is_optimizer(self.ctx.names, mc[0])):
                    return dotted_name(mc[0]) or ""
        return ""

    def _has_optimizer(self, d: cst.Dict) -> bool:
        for el in d.elements:
            if not isinstance(el, cst.DictElement):
                continue
            v = el.value
            if isinstance(v, cst.Name) and v.value == "None":
                continue  # `"optimizer": None` in a final, weights-only checkpoint
            key = h.string_value(el.key)
            if key is not None and "optim" in key.lower():
                return True
            if isinstance(v, cst.Call):
                mc = h.method_call(v, "state_dict")
                if mc is not None and voc.is_optimizer(self.ctx.names, mc[0]):
                    return True
        return False

    def _has_scaler(self, d: cst.Dict) -> bool:
        for el in d.elements:
            if isinstance(el, cst.StarredDictElement):
                return True  # `**extra` may carry it
            key = h.string_value(el.key)
            if key is None and not isinstance(el.key, cst.SimpleString):
                return True  # a computed key
            if key is not None and ("scaler" in key.lower() or key.lower() in ("amp", "amp_state")):
                return True
            for n in [el.value, *h.walk(el.value, enter_scopes=True)]:
                d = dotted_name(n)
                if d is not None and ("scaler" in d.lower() or d.rsplit(".", 1)[-1] == "amp"):
                    return True
        return False
