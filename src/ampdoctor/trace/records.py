"""What the tracer keeps over a run: per-module and per-parameter aggregates, the GradScaler's
steps, where NaN/Inf started, and the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ampdoctor.trace import stats as st
from ampdoctor.trace.formats import LOW_PRECISION


SERIES_POINTS = 256  # points per layer in the report's absmax-over-steps series


@dataclass
class ModuleAgg:
    """Everything seen for one (module, phase) over the run."""

    key: int
    cls: str
    phase: str
    dtypes: set[str] = field(default_factory=set)
    calls: int = 0
    absmax: float = 0.0
    min_nonzero: float = math.inf
    elements: float = 0.0
    counts: list[float] = field(default_factory=lambda: [0.0] * st.NCOUNTS)
    nonfinite_steps: list[int] = field(default_factory=list)
    origin_steps: list[int] = field(default_factory=list)  # finite in, non-finite out
    overflow_steps: list[int] = field(default_factory=list)  # low-precision outputs overflowed to inf
    exceed_steps: list[int] = field(default_factory=list)  # outputs past fp16's range from inputs within it
    tensors_fp32: bool = False
    # the largest |value| per step, in buckets of ``bucket`` steps (at most SERIES_POINTS of them):
    # first step of the bucket -> absmax (inf when NaN/inf was seen)
    series: dict[int, float] = field(default_factory=dict)
    bucket: int = 1
    slot: int = -1  # its row in the tracer's CountSums (-1: counts are added here)

    @staticmethod
    def mark(steps: list[int], step: int) -> None:
        if not steps or steps[-1] != step:
            steps.append(step)

    @property
    def classes(self) -> dict[str, dict[str, float]]:
        return st.counts_to_classes(self.counts)

    def _saw(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            self.dtypes.add(dtype)
            if dtype not in LOW_PRECISION:
                self.tensors_fp32 = True

    def add(self, s: st.TensorSummary, step: int | None = None, sums: st.CountSums | None = None) -> None:
        a = s.absmax
        if step is not None:
            self.add_point(step, a if s.finite else math.inf)
        self._saw(s.dtype)
        if a != a:
            self.absmax = math.nan
        elif a > self.absmax:
            self.absmax = a
        if s.min_nonzero < self.min_nonzero:
            self.min_nonzero = s.min_nonzero
        self.elements += s.numel
        add_counts(self, s, sums)

    def add_row(self, r: tuple, step: int, sums: st.CountSums, m: st.Measured) -> None:
        """``add`` for a finite tensor, from its ``Measured`` tuple."""
        a, lowest = r[5], r[6]
        self.add_point(step, a)
        self._saw(r[1])
        if a > self.absmax:
            self.absmax = a
        if lowest < self.min_nonzero:
            self.min_nonzero = lowest
        self.elements += r[2]
        add_row_counts(self, r, sums, m)

    def add_point(self, step: int, value: float) -> None:
        b = step - step % self.bucket
        old = self.series.get(b)
        if old is None or value > old or value != value:
            self.series[b] = math.inf if value != value else value
        if len(self.series) > SERIES_POINTS:
            self._rebucket(self.bucket * 2)

    def _rebucket(self, bucket: int) -> None:
        merged: dict[int, float] = {}
        for s, v in self.series.items():
            b = s - s % bucket
            merged[b] = max(merged.get(b, v), v)
        self.series, self.bucket = merged, bucket

    def merge(self, other: "ModuleAgg") -> None:
        if other.series:
            if other.bucket > self.bucket:
                self._rebucket(other.bucket)
            for s, v in other.series.items():
                self.add_point(s, v)
        self.dtypes |= other.dtypes
        self.tensors_fp32 |= other.tensors_fp32
        self.calls += other.calls
        self.absmax = math.nan if math.isnan(other.absmax) or math.isnan(self.absmax) else max(self.absmax,
                                                                                                 other.absmax)
        self.min_nonzero = min(self.min_nonzero, other.min_nonzero)
        self.elements += other.elements
        self.counts = [x + y for x, y in zip(self.counts, other.counts)]
        for name in ("nonfinite_steps", "origin_steps", "overflow_steps", "exceed_steps"):
            setattr(self, name, sorted(set(getattr(self, name)) | set(getattr(other, name))))


def add_counts(agg, s: st.TensorSummary, sums: st.CountSums | None) -> None:
    """Add a summary's class counts to an aggregate: to its row of ``sums`` when it has one (what
    the exact extremes correct is added here), else to its own list."""
    if sums is not None and agg.slot >= 0 and s.src is not None:
        sums.add(agg.slot, s)
        if s.fix:
            agg.counts = [x + y for x, y in zip(agg.counts, s.extra())]
    else:
        agg.counts = [x + y for x, y in zip(agg.counts, s.counts)]


def add_row_counts(agg, r: tuple, sums: st.CountSums, m: st.Measured) -> None:
    """``add_counts`` for a finite tensor's ``Measured`` tuple: to the aggregate's row of ``sums``,
    now (``put``) or when the deferred CPU block holding it is counted (``own``)."""
    at, scale, a, rid = r[0], r[4], r[5], r[7]
    if agg.slot < 0:  # no row in the sums: its own counts, now
        s = m.summary(r)
        agg.counts = [x + y for x, y in zip(agg.counts, s.counts)]
        if isinstance(agg, ModuleAgg):
            agg.min_nonzero = min(agg.min_nonzero, s.min_nonzero)
    elif rid >= 0:
        sums.own(rid, agg.slot, scale, a)
    else:
        sums.put(agg.slot, at, scale, m.src, a)


@dataclass
class ParamAgg:
    """One parameter's gradients over the run (measured when the optimizer was about to use them)."""

    key: int
    dtypes: set[str] = field(default_factory=set)
    steps: int = 0
    absmax: float = 0.0
    elements: float = 0.0
    counts: list[float] = field(default_factory=lambda: [0.0] * st.NCOUNTS)
    nonfinite_steps: list[int] = field(default_factory=list)
    scaled: bool = False  # measured before GradScaler.unscale_ (the values are loss-scaled)
    slot: int = -1  # its row in the tracer's CountSums (-1: counts are added here)

    @property
    def classes(self) -> dict[str, dict[str, float]]:
        return st.counts_to_classes(self.counts)


@dataclass
class StepRecord:
    """What the GradScaler did in one step."""

    step: int
    scale: float | None = None
    new_scale: float | None = None
    skipped: bool | None = None
    first_bad_grad: int | None = None  # the module key of the step's backward origin
    bad_params: list[int] = field(default_factory=list)
    grads_nonfinite: bool = False  # any activation gradient was non-finite
    fp16: bool = False  # some gradient of the step was float16: the loss scale can overflow it


@dataclass
class Origin:
    """Where a non-finite value first appeared in one step."""

    step: int
    phase: str  # "forward", "loss", "backward" or "param"
    key: int | None  # module key; None for the loss and for code outside any module
    kind: str  # "overflow" or "nonfinite"
    produced: str = "nan"  # "nan" or "inf"
    also: list[int] = field(default_factory=list)  # modules that cannot be told apart from this one
    seq: int = -1  # when it happened (-1: not yet known): origins are reported in this order
    params: list[int] = field(default_factory=list)
    node: dict | None = None  # the autograd node / aten op, when the replay could name it
    dtype: str | None = None
    stored: list[str] = field(default_factory=list)  # own parameters/buffers that already held NaN/Inf
    via: str | None = None  # "autograd.grad": the gradients torch.autograd.grad returned were non-finite
    cast_from: float | None = None  # the largest |value| of a wider input that its cast to ``dtype`` overflowed


@dataclass
class LossAgg:
    steps: int = 0
    absmax: float = 0.0
    dtypes: set[str] = field(default_factory=set)
    nonfinite_steps: list[int] = field(default_factory=list)
    nonzero: bool = False
    last: int | None = None  # the last step counted
