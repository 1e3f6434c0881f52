from __future__ import annotations

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.masks import NegInfFill


class NegInfPaddingMask(NegInfFill):
    """A -inf padding fill before a softmax in attention that is also causal: left-padded rows are NaN."""

    code = "AMP202"
    name = "neg-inf-padding-mask"
    severity = Severity.WARNING
    reports = "causal"
    message = ("`{call}` fills a padding mask with -inf before a causal softmax: these scores "
               "also get a causal mask, so a left-padded query row can see only padded keys, so every entry of its row is -inf and "
               "the softmax gives NaN (in float32 too), which then spreads through the batch. Fill with "
               "`torch.finfo({recv}.dtype).min`, or use `F.scaled_dot_product_attention`.")
    fix_availability = "suggestion"
    summary = "A -inf padding mask before a softmax in causal attention: left-padded rows turn into NaN."
