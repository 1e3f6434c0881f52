from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import backward
from ampdoctor.lint.semantic import vocabulary as voc

# calls that may follow the backward at the end of the block and leave with it
_AFTER_BACKWARD = ("backward", "step", "update", "zero_grad", "unscale_")
_CLIPS = {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
          "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_"}


class BackwardInsideAutocast(Rule):
    """A backward pass run inside an autocast-enabled region."""

    code = "AMP302"
    name = "backward-inside-autocast"
    severity = Severity.WARNING
    message = ("`{call}` runs inside an autocast region that {reason}: autocast recasts the backward ops of "
               "that part of the graph, so its gradients differ from those of a backward run after the block. "
               "Leave the `with` block before the backward pass.")
    fix_title = "Move the backward pass out of the autocast block"
    fix_availability = "unsafe"
    words = (b"autocast",)
    summary = ("`.backward()` or `torch.autograd.grad()` inside an autocast region whose graph was partly "
               "recorded in another autocast state.")

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        q = names.qualified(node.func)
        if q in backward.AUTOGRAD_CALLS:
            call = q + "(...)"
        elif h.method_call(node, "backward") is not None:
            call = ".backward()"
        else:
            return
        regions = acs.regions(self.ctx)
        if not regions or regions[0].ac.enabled is False:
            return
        if voc.in_test(self.ctx):
            return  # a test or benchmark timing the backward under autocast: no training is affected
        ac, region = regions[0].ac, regions[0].node
        conditional = ac.enabled is None or (ac.dtype_expr is not None and ac.dtype is None)
        if conditional and self._in_amp_off_arm(region):
            return  # `if scaler is None: loss.backward()`: the arm of the mode the region does not lower
        if self._refuses_amp():
            return  # `if self.use_amp: raise NotImplementedError`: this code never trains under AMP
        effect = backward.computed_outside(self.ctx, node, regions[0])
        if effect is not None:
            effect = f"did not compute `{effect}`"
        else:
            effect = backward.float32_part(self.ctx, node, regions[0])
        self.emit(node, call, region, effect)

    def emit(self, node: cst.Call, call: str, region: cst.CSTNode, effect: str | None) -> None:
        """Report when part of the graph was recorded in another autocast state (``effect`` says which)."""
        if effect is not None:
            self.report(node, self.message.format(call=call, reason=effect), self._fix(region))

    def _in_amp_off_arm(self, region: cst.CSTNode) -> bool:
        """Inside the region, in the arm of an `if` about the precision that runs without AMP:
        the body of `if scaler is None:` / `if not use_amp:`, the else of `if use_amp:`."""
        stack = self.ctx.parents
        for i in range(len(stack) - 2, -1, -1):
            p, child = stack[i], stack[i + 1]
            if p is region:
                return False
            if not isinstance(p, cst.If) or child is p.test or not u.precision_test(self.ctx.names, p.test):
                continue
            test, negated = p.test, False
            if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                test, negated = test.expression, True
            if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and \
                    isinstance(test.comparisons[0].comparator, cst.Name) and \
                    test.comparisons[0].comparator.value == "None":
                op = test.comparisons[0].operator
                negated ^= isinstance(op, cst.Is)  # `x is None`: the body runs without AMP
            in_body = child is p.body
            return in_body == negated
        return False

    def _refuses_amp(self) -> bool:
        """The enclosing function raises in its AMP mode (`if self.use_amp: raise ...`)."""
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, cst.FunctionDef)), None)
        if fn is None:
            return False
        for n in h.walk(fn.body):
            if isinstance(n, cst.If) and u.precision_test(self.ctx.names, n.test) and \
                    isinstance(n.body, cst.IndentedBlock) and n.body.body and \
                    isinstance(n.body.body[0], cst.SimpleStatementLine) and \
                    any(isinstance(x, cst.Raise) for x in n.body.body[0].body):
                return True
        return False

    def _simple(self, expr: cst.CSTNode) -> bool:
        """An expression that computes nothing autocast would touch: names, literals,
        ``m.parameters()``, ``scaler.scale(loss)``."""
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return dotted_name(expr) is not None
        if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
            return True
        if isinstance(expr, cst.UnaryOperation):
            return self._simple(expr.expression)
        if isinstance(expr, (cst.Tuple, cst.List)):
            return all(self._simple(e.value) for e in expr.elements)
        if isinstance(expr, cst.Call):
            mc = h.method_call(expr, "parameters", "scale")
            if mc is None or not self._simple(mc[0]):
                return False
            if mc[1] == "scale" and not voc.is_scaler(self.ctx.names, mc[0]):
                return False
            return all(self._simple(a.value) for a in expr.args)
        return False

    def _is_backward_statement(self, stmt: cst.CSTNode) -> bool:
        """``loss.backward()``, ``scaler.step(opt)``, ``grads = torch.autograd.grad(...)``, clipping."""
        if not isinstance(stmt, cst.SimpleStatementLine):
            return False
        for small in stmt.body:
            if isinstance(small, cst.Expr):
                value = small.value
            elif isinstance(small, cst.Assign):
                value = small.value
            else:
                return False
            if not isinstance(value, cst.Call):
                return False
            if not all(self._simple(a.value) for a in value.args):
                return False
            q = self.ctx.names.qualified(value.func)
            if q in backward.AUTOGRAD_CALLS or q in _CLIPS:
                continue
            mc = h.method_call(value, *_AFTER_BACKWARD)
            if isinstance(small, cst.Expr) and mc is not None and self._simple(mc[0]):
                continue
            return False
        return True

    def _fix(self, region: cst.CSTNode) -> FixSpec | None:
        """Dedent the trailing backward statements when the current call is one of them."""
        if not isinstance(region, cst.With) or len(region.items) != 1 or region.asynchronous is not None:
            return None
        body = region.body
        if not isinstance(body, cst.IndentedBlock):
            return None
        stack = self.ctx.parents
        try:
            i = stack.index(body)
        except ValueError:
            return None
        stmt = stack[i + 1] if i + 1 < len(stack) else None
        statements = list(body.body)
        if stmt not in statements:
            return None
        idx = next(k for k, s in enumerate(statements) if s is stmt)
        start = idx
        while start > 0 and self._is_backward_statement(statements[start - 1]):
            start -= 1
        if not all(self._is_backward_statement(s) for s in statements[start:]):
            return None
        # the trailing statements must not use what the with binds
        if region.items[0].asname is not None:
            bound = u.bound_names(region.items[0].asname)
            if any(u.depends_on(s, bound) for s in statements[start:]):
                return None
        moved = statements[start:]
        kept = statements[:start]
        if kept:
            out = [region.with_changes(body=body.with_changes(body=kept)), *moved]
        else:
            first = moved[0].with_changes(leading_lines=[*region.leading_lines, *moved[0].leading_lines])
            out = [first, *moved[1:]]
        return FixSpec(((region, cst.FlattenSentinel(out)),), safe=False, title=self.fix_title)
