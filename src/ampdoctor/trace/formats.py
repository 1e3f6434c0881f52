"""Floating-point formats the tracer judges values against (plain numbers, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    max: float  # largest finite value
    overflow: float  # |x| >= overflow rounds to inf (round to nearest even)
    smallest_normal: float
    smallest_subnormal: float
    bits: int  # significand bits, the implicit one included

    @property
    def flush(self) -> float:
        """|x| <= flush rounds to zero."""
        return self.smallest_subnormal / 2

    def headroom_bits(self, absmax: float) -> float | None:
        if not absmax or math.isnan(absmax):
            return None
        if math.isinf(absmax):
            return -math.inf
        return math.log2(self.max / absmax)


FLOAT16 = Format("float16", 65504.0, 65520.0, 2.0 ** -14, 2.0 ** -24, 11)
BFLOAT16 = Format("bfloat16", 2.0 ** 127 * (2 - 2.0 ** -7), 2.0 ** 127 * (2 - 2.0 ** -8), 2.0 ** -126, 2.0 ** -133, 8)
FORMATS = {"float16": FLOAT16, "bfloat16": BFLOAT16}
LOW_PRECISION = ("float16", "bfloat16")
# --compare: a layer that loses this many of its format's bits itself is marked and advised
LOSSY_BITS = 3.0
