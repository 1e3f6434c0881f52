"""Per-tensor statistics computed on the tensor's device, with no host synchronisation.

Each tensor costs four small ops: ``aminmax`` over the whole tensor (exact extremes; NaN and
±inf show up there), then ``bucketize`` + ``bincount`` of its values (or of an evenly strided
sample of at most ``SAMPLE`` values, ``SAMPLE_CPU`` on the CPU, for large tensors) against one set of boundaries that holds
the fp16 and bf16 overflow, normal, subnormal and flush-to-zero thresholds plus a power-of-two
grid. The host decodes the bucket counts into classes for either format after the one
device-to-host copy per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ampdoctor.trace.formats import BFLOAT16, FLOAT16, FORMATS, Format

SAMPLE = 1 << 16  # values bucketed per tensor on accelerators
SAMPLE_CPU = 1 << 12  # CPU bucketize costs ~100 ns a value: a smaller sample keeps it cheap
CLASSES = ("nan", "pinf", "ninf", "overflow", "normal", "subnormal", "flush", "zero")
_F32_MAX = float(torch.finfo(torch.float32).max)


def _below(x: float) -> float:
    """The largest float32 strictly below x (x > 0)."""
    t = torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0, dtype=torch.float32))
    return float(t)


def _edges() -> list[float]:
    pos = {2.0 ** k for k in range(-40, 21)}
    for f in (FLOAT16, BFLOAT16):
        pos |= {f.flush, _below(f.smallest_normal), _below(f.overflow)}
    pos.add(_F32_MAX)
    pos = {float(torch.tensor(p, dtype=torch.float32)) for p in pos}
    return sorted({-math.inf, 0.0, math.inf} | pos | {-p for p in pos})


EDGES = _edges()
NBUCKETS = len(EDGES) + 1  # bucketize returns 0..len(EDGES); NaN lands on len(EDGES)


@dataclass(frozen=True)
class Bucket:
    lo_mag: float  # smallest magnitude the bucket can hold (for min_nonzero)
    rep: float  # a value inside the bucket, used to classify it


def _buckets() -> list[Bucket]:
    out = []
    for i in range(NBUCKETS):
        if i == 0:
            out.append(Bucket(math.inf, -math.inf))
        elif i == len(EDGES):
            out.append(Bucket(math.nan, math.nan))
        else:
            lo, hi = EDGES[i - 1], EDGES[i]
            if hi == math.inf:
                out.append(Bucket(math.inf, math.inf))
            elif lo == -math.inf:
                out.append(Bucket(abs(hi), hi))
            elif hi == 0.0:
                out.append(Bucket(0.0, 0.0))
            elif lo >= 0.0:
                out.append(Bucket(lo, (lo + hi) / 2))
            else:
                out.append(Bucket(abs(hi), (lo + hi) / 2))
    return out


BUCKETS = _buckets()


def classify(value: float, fmt: Format) -> str:
    if math.isnan(value):
        return "nan"
    if value == math.inf:
        return "pinf"
    if value == -math.inf:
        return "ninf"
    mag = abs(value)
    if mag == 0.0:
        return "zero"
    if mag >= fmt.overflow:
        return "overflow"
    if mag >= fmt.smallest_normal:
        return "normal"
    if mag > fmt.flush:
        return "subnormal"
    return "flush"


# bucket index -> class index, per format
CLASS_OF = {name: [CLASSES.index(classify(b.rep, f)) for b in BUCKETS] for name, f in FORMATS.items()}

_BOUNDS: dict[torch.device, torch.Tensor] = {}


def bounds_for(device: torch.device) -> torch.Tensor:
    b = _BOUNDS.get(device)
    if b is None:
        b = _BOUNDS[device] = torch.tensor(EDGES, dtype=torch.float32, device=device)
    return b


def measurable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and \
        t.device.type != "meta" and not t.is_complex()


def device_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(min/max as a 2-vector, bucket counts, numel, sampled numel), all on the device."""
    x = t.detach()
    n = x.numel()
    mm = torch.stack(torch.aminmax(x))
    limit = SAMPLE_CPU if x.device.type == "cpu" else SAMPLE
    if n <= limit:
        flat = x.reshape(-1)
        if not flat.is_contiguous():  # an expanded tensor (stride 0), e.g. the gradient of a sum
            flat = flat.contiguous()
    elif x.is_contiguous():
        flat = x.view(-1)[:: -(-n // limit)].contiguous()
    else:  # gather the sample only: reshape(-1) would copy the whole tensor
        flat = torch.take(x, _sample_index(n, limit, x.device))
    idx = torch.bucketize(flat, bounds_for(x.device))
    return mm, _count(idx), n, flat.numel()


_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}


def _sample_index(n: int, limit: int, device: torch.device) -> torch.Tensor:
    """Evenly strided flat indices of at most ``limit`` elements (cached per size and device)."""
    key = (n, device)
    idx = _INDEX.get(key)
    if idx is None:
        if len(_INDEX) > 256:
            _INDEX.clear()
        idx = _INDEX[key] = torch.arange(0, n, -(-n // limit), device=device)
    return idx


def _count(idx: torch.Tensor) -> torch.Tensor:
    """Occurrences of each bucket index, without a host sync.

    CPU ``bincount`` is synchronous anyway; on accelerators ``bincount`` reads the maximum
    back to size its output, so a fixed-size ``index_add_`` is used instead (or, under
    ``torch.use_deterministic_algorithms``, a one-hot sum, which is deterministic)."""
    if idx.device.type == "cpu":
        return torch.bincount(idx, minlength=NBUCKETS)
    if torch.are_deterministic_algorithms_enabled():
        return (idx.unsqueeze(-1) == torch.arange(NBUCKETS, device=idx.device)).sum(0)
    ones = torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel())
    return torch.zeros(NBUCKETS, dtype=torch.int64, device=idx.device).index_add_(0, idx, ones)


@dataclass
class TensorSummary:
    """Host-side summary of one tensor (or of several, once merged)."""

    dtype: str
    numel: int
    absmax: float
    vmin: float
    vmax: float
    min_nonzero: float  # a lower bound, within a factor of two
    classes: dict[str, dict[str, float]] = field(default_factory=dict)  # format -> class -> count
    sampled: bool = False

    @property
    def nonfinite(self) -> dict[str, float]:
        c = self.classes["float16"]
        return {"nan": c["nan"], "pinf": c["pinf"], "ninf": c["ninf"]}

    @property
    def finite(self) -> bool:
        return not any(self.nonfinite.values())


_MATRICES: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}


def _matrices(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Bucket -> class one-hot matrices (one per format) and each bucket's lower magnitude."""
    key = (device, dtype)
    hit = _MATRICES.get(key)
    if hit is None:
        mats = []
        for name in FORMATS:
            m = torch.zeros(NBUCKETS, len(CLASSES), dtype=dtype)
            for i, c in enumerate(CLASS_OF[name]):
                m[i, c] = 1
            mats.append(m.to(device))
        lo = [b.lo_mag if (b.lo_mag > 0 and not math.isinf(b.lo_mag) and not math.isnan(b.lo_mag)) else math.inf
              for b in BUCKETS]
        hit = _MATRICES[key] = (*mats, torch.tensor(lo, dtype=dtype, device=device))
    return hit


ROW = 2 + len(FORMATS) * len(CLASSES) + 1  # values per tensor after reduce()


def reduce(mms: list[torch.Tensor], counts: list[torch.Tensor]) -> torch.Tensor:
    """On the device: per tensor (min, max, class counts for each format, smallest bucket magnitude),
    as one flat vector of ROW values a tensor, ready for a single transfer."""
    device = mms[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    mm = torch.stack(mms).to(dtype)
    c = torch.stack(counts).to(dtype)
    *mats, lo = _matrices(device, dtype)
    lowest = torch.where(c > 0, lo, torch.full_like(lo, math.inf)).amin(dim=1, keepdim=True)
    return torch.cat([mm, *(c @ m for m in mats), lowest], dim=1).reshape(-1)


def summarise(dtype: str, row: list[float], numel: int, sampled_n: int) -> TensorSummary:
    """Host-side summary of one tensor from its ROW values."""
    vmin, vmax = row[0], row[1]
    scale = numel / sampled_n if sampled_n else 1.0
    classes = {}
    k = len(CLASSES)
    for j, name in enumerate(FORMATS):
        vals = row[2 + j * k: 2 + (j + 1) * k]
        classes[name] = {c: v * scale for c, v in zip(CLASSES, vals)}
    has_nan = math.isnan(vmin) or math.isnan(vmax)
    for name in FORMATS:  # the exact extremes guarantee at least one when present
        acc = classes[name]
        if has_nan and acc["nan"] < 1:
            acc["nan"] = 1.0
        if vmax == math.inf and acc["pinf"] < 1:
            acc["pinf"] = 1.0
        if vmin == -math.inf and acc["ninf"] < 1:
            acc["ninf"] = 1.0
    lo = row[-1]
    absmax = math.nan if has_nan else max(abs(vmin), abs(vmax))
    return TensorSummary(dtype, numel, absmax, vmin, vmax, lo, classes, sampled_n < numel)
