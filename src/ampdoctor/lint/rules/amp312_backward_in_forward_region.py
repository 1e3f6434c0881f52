from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rules.amp302_backward_inside_autocast import BackwardInsideAutocast


class BackwardInForwardRegion(BackwardInsideAutocast):
    """A backward pass left in the autocast region that ran its whole forward pass (opt-in)."""

    code = "AMP312"
    name = "backward-in-forward-region"
    severity = Severity.INFO
    message = ("`{call}` runs inside the autocast region of its own forward pass: PyTorch advises against "
               "it, although the gradients are the same here, as nothing in the region ran in another "
               "autocast state. Leave the `with` block before the backward pass.")
    default = False
    summary = ("`.backward()` inside the autocast region that ran its whole forward pass: against "
               "PyTorch's guidance, same gradients (opt-in).")

    def emit(self, node: cst.Call, call: str, region: cst.CSTNode, effect: str | None) -> None:
        if effect is None:
            self.report(node, self.message.format(call=call), self._fix(region))
