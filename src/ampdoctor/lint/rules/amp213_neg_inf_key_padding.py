from __future__ import annotations

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.masks import NegInfFill


class NegInfKeyPadding(NegInfFill):
    """A -inf key-padding fill before a softmax (no causal mask): NaN only for an all-padding sequence."""

    code = "AMP213"
    name = "neg-inf-key-padding"
    severity = Severity.INFO
    default = False
    reports = "padding"
    message = ("`{call}` fills a padding mask with -inf before a softmax: a sequence that is all padding "
               "(an empty input) masks a whole row, which the softmax turns into NaN, in float32 too. Fill "
               "with `torch.finfo({recv}.dtype).min`, or use `F.scaled_dot_product_attention`.")
    fix_availability = "suggestion"
    summary = "A -inf key-padding mask before a softmax: an all-padding sequence gives a NaN row (opt-in)."
