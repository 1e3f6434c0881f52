from __future__ import annotations

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.facts import facts_of

_SCALER_METHODS = ("scale", "step", "unscale_", "update")
# what a step function may do with a scaler it keeps to itself
_LOCAL_USES = (*_SCALER_METHODS, "state_dict", "get_scale", "is_enabled")


class GradScalerInLoop(Rule):
    """A GradScaler constructed on every iteration of a training or epoch loop."""

    code = "AMP107"
    name = "grad-scaler-in-loop"
    severity = Severity.WARNING
    message = ("`{c}(...)` is created anew on every iteration of this {kind} loop: the loss scale "
               "restarts at its initial value each time and never settles. Create the scaler once, "
               "before the loop.")
    fix_title = "Hoist the GradScaler out of the loop"
    fix_availability = "unsafe"
    words = (b"GradScaler",)
    summary = "A `GradScaler` is created inside the training or epoch loop instead of once before it."

    per_call_message = ("`{c}(...)` is created anew on every call of `{f}`: `{caller}` calls it in a loop, so the "
                        "scaler lives for one step and the loss scale restarts at its initial value each time, never "
                        "settling. Create the scaler once (in `__init__` or before the loop) and reuse it.")

    per_epoch_message = ("`{c}(...)` is created anew in every epoch: `{caller}` calls `{f}` once per epoch, so "
                         "the loss scale restarts at its initial value every epoch, skipping steps again while it "
                         "backs off, and a checkpoint of it is worth nothing. Create the scaler once, before the "
                         "epoch loop, and pass it in.")

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        if not u.is_grad_scaler_ctor(names, node):
            return
        loop = h.enclosing_loop(self.ctx)
        if loop is None:
            self._per_call(node)
            return
        kind = self._kind(loop)
        if kind is None:
            return
        callee = u.code(node.func)
        self.report(node, self.message.format(c=callee, kind=kind), self._fix(node, loop))

    def _per_call(self, node: cst.Call) -> None:
        """`scaler = GradScaler()` local to a step function that steps it once and is called in a
        loop: a new scaler (scale 65536, no growth history) on every step."""
        stack = self.ctx.parents
        assign = stack[-2] if len(stack) >= 2 else None
        if isinstance(assign, cst.IfExp) and len(stack) >= 3:  # `GradScaler() if c.mixed_precision else None`
            assign = stack[-3]
        if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)):
            return
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, h.SCOPES)), None)
        if not isinstance(fn, cst.FunctionDef):
            return
        name = assign.targets[0].target.value
        if self._escapes(fn, assign, name) is not False:
            return  # it escapes (returned, stored, passed on) and may live on, or it never steps
        graph = facts_of(self.ctx).calls
        # a step function called in any loop; a function that steps it in a loop of its own is one
        # epoch, and only an epoch loop around its call remakes it too often (mozilla TTS)
        hit = graph.run_anew(fn, name)
        info = graph.function(fn)
        if hit is not None and info is not None:
            message = self.per_epoch_message if graph.loops_itself(fn, name) else self.per_call_message
            self.report(node, message.format(c=u.code(node.func), f=info.qualname, caller=hit[0].qualname))

    @staticmethod
    def _escapes(fn: cst.FunctionDef, assign: cst.Assign, name: str) -> bool | None:
        """False when the scaler stays local to ``fn`` and steps there; True when it escapes
        (returned, stored, passed on: it may live on); None when it never steps."""
        # the method called on each name that is a receiver (`scaler.step`)
        receivers = {id(a.value): a.attr.value for a in h.walk(fn.body)
                     if isinstance(a, cst.Attribute) and isinstance(a.value, cst.Name)}
        # `if scaler is not None:`, `if scaler:`: looked at, not passed on
        tested = {id(x) for n in h.walk(fn.body) for x in _tested(n)}
        stepped = False
        for n in h.walk(fn.body):
            if isinstance(n, cst.Name) and n.value == name and n is not assign.targets[0].target:
                if id(n) in tested:
                    continue
                attr = receivers.get(id(n))
                if attr not in _LOCAL_USES:
                    return True
                stepped = stepped or attr == "step"
        return False if stepped else None

    def _kind(self, loop: cst.CSTNode) -> str | None:
        """"epoch" or "training" when the loop is one, else None (a loop over configurations,
        folds or models that builds a fresh optimizer each time is a new run, not a bug)."""
        names = self.ctx.names
        body = list(h.walk(loop.body))
        for n in body:
            if isinstance(n, cst.Call):
                q = names.qualified(n.func) or ""
                if q.startswith("torch.optim.") and "lr_scheduler" not in q:
                    return None
            if isinstance(n, (cst.Assign, cst.AnnAssign)):
                targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                for t in targets:
                    d = dotted_name(t)
                    if d and "optim" in d.rsplit(".", 1)[-1].lower():
                        return None
        if h.epoch_loop(loop):
            return "epoch"
        for n in self._direct(loop.body):
            if h.method_call(n, "backward") is not None:
                return "training"
            mc = h.method_call(n, *_SCALER_METHODS)
            if mc is not None and voc.is_scaler(names, mc[0]):
                return "training"
        return None

    @staticmethod
    def _direct(node: cst.CSTNode):
        """Descendants of ``node`` that are not inside a nested loop or def."""
        stack = list(reversed(_tree.children(node)))
        while stack:
            n = stack.pop()
            yield n
            if isinstance(n, h.SCOPES + h.LOOPS):
                continue
            stack.extend(reversed(_tree.children(n)))

    def _fix(self, call: cst.Call, loop: cst.CSTNode) -> FixSpec | None:
        stack = self.ctx.parents
        # call <- Assign <- SimpleStatementLine <- IndentedBlock (loop.body) <- loop
        if len(stack) < 5:
            return None
        assign, line, block, owner = stack[-2], stack[-3], stack[-4], stack[-5]
        if not (isinstance(assign, (cst.Assign, cst.AnnAssign)) and assign.value is call
                and isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1
                and block is loop.body and owner is loop and isinstance(block, cst.IndentedBlock)):
            return None
        if isinstance(assign, cst.Assign):
            if len(assign.targets) != 1:
                return None
            target = dotted_name(assign.targets[0].target)
        else:
            target = dotted_name(assign.target)
        if target is None:
            return None
        bound = u.bound_names(loop)
        if u.depends_on(call, bound):
            return None
        # the scaler is bound only here, and the loop header does not read it
        count = 0
        for n in h.walk(loop.body):
            if isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                ts = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                if any(dotted_name(t) == target for t in ts):
                    count += 1
        if count != 1:
            return None
        if any(target in u.chains(part) for part in h.loop_header(loop)):
            return None
        # the statements before it in the body must not read the scaler (they would see
        # last iteration's value, and after the hoist the new one)
        idx = next(i for i, s in enumerate(block.body) if s is line)
        if any(target in u.chains(s) for s in block.body[:idx]):
            return None
        rest = [s for s in block.body if s is not line]
        comments = [ll for ll in line.leading_lines if ll.comment is not None]
        hoisted = line.with_changes(leading_lines=[*loop.leading_lines, *comments])
        if not rest:
            rest = [cst.SimpleStatementLine([cst.Pass()])]
        elif idx == 0:
            rest[0] = rest[0].with_changes(leading_lines=[
                ll for ll in rest[0].leading_lines if ll.comment is not None])
        new_loop = loop.with_changes(leading_lines=[], body=block.with_changes(body=rest))
        return FixSpec(((loop, cst.FlattenSentinel([hoisted, new_loop])),), safe=False, title=self.fix_title)



def _tested(n: cst.CSTNode) -> list[cst.CSTNode]:
    """The names a test only looks at: `x is None`, `x is not None`, a bare `if x:` / `not x`."""
    if isinstance(n, cst.Comparison):
        return [n.left, *(c.comparator for c in n.comparisons)]
    if isinstance(n, (cst.If, cst.While, cst.IfExp)):
        return [n.test]
    if isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not):
        return [n.expression]
    if isinstance(n, cst.BooleanOperation):
        return [n.left, n.right]
    return []
