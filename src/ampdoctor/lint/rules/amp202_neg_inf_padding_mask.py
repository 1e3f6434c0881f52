from __future__ import annotations

import re

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.masks import NegInfFill

# the file pads on the left (batched generation, decoder-only fine-tuning): only then does a
# causal query row see nothing but padded keys
_LEFT_PADDING = re.compile(r"""padding_side\s*[=:]\s*["']left["']|\bleft[_ -]?pad|\bpad(?:ding)?[_ ]left""", re.I)


class NegInfPaddingMask(NegInfFill):
    """A -inf padding fill before a softmax in attention that is also causal: left-padded rows are NaN."""

    code = "AMP202"
    name = "neg-inf-padding-mask"
    severity = Severity.WARNING
    reports = "causal"
    message = ("`{call}` fills a padding mask with -inf before a causal softmax: this file pads on the left "
               "and these scores also get a causal mask, so a left-padded query row sees only padded keys, every "
               "entry of its row is -inf and the softmax gives NaN (in float32 too), which then spreads through "
               "the batch. Fill with "
               "`torch.finfo({recv}.dtype).min`, or use `F.scaled_dot_product_attention`.")
    fix_availability = "suggestion"
    summary = "A -inf padding mask before a softmax in causal attention: left-padded rows turn into NaN."
    _left: bool | None = None

    def possible(self) -> bool:
        """Left padding in the file (`padding_side="left"`, `left_pad`): with right padding a
        padded query row still sees the real keys before it, and no row is fully masked."""
        if self._left is None:
            self._left = bool(_LEFT_PADDING.search(self.ctx.text))
        return self._left
