"""Per-tensor statistics computed on the tensor's device, with no host synchronisation.

Each tensor costs two small ops: ``aminmax`` over the whole tensor (exact extremes; NaN and ±inf
show up there) and a float32 copy of its values, or of a sample of them for larger tensors (an
evenly strided view of up to ``SAMPLE`` values on accelerators; ``SAMPLE_CPU`` values spread
over the tensor through a cached index on the CPU), into its own row of a block. Once per
step (or per full block) the rows are counted together by bucket, where a value's bucket is the
top ten bits of its float32 pattern: the sign, the exponent and the first mantissa bit, so each
bucket spans half a binade. Computing the key is a shift, not a search, so its cost does not
depend on the data. The fp16 and bf16 normal, subnormal and flush-to-zero thresholds fall on
bucket edges; the two overflow thresholds (65,520 and about 3.39e38) fall inside a bucket, so
which values overflow is settled by the exact extremes. Float32 subnormals below 2^-127 share
the zero bucket. The counts are reduced to the classes of either format on the device, and the
host reads them in the one device-to-host copy per optimizer step.

On the CPU, where counting a block has a fixed cost of a dozen ops that a step's few hundred
rows do not pay back, the tracer's batch keeps its block over many steps (``defer``): each step
transfers only the extremes, which are all the step's analysis needs (NaN, inf, the float16
range), and a block's counts reach the aggregates that own its rows when it is full or the trace
ends (``CountSums.own``/``apply``). A tensor with NaN or inf has its row counted at once.
"""

from __future__ import annotations

import math
import struct
from array import array
from dataclasses import dataclass

import torch

from ampdoctor.trace.formats import FORMATS, Format

SAMPLE = 1 << 16  # values counted per tensor on accelerators
SAMPLE_CPU = 1 << 8  # on the CPU each value counted costs time the step itself would use: 256
#                     values give a class fraction to within 3.1 points per call (one standard
#                     error at worst), and the counts add up over calls and steps
CLASSES = ("nan", "pinf", "ninf", "overflow", "normal", "subnormal", "flush", "zero")
KEY_SHIFT = 22  # float32 bits >> 22: sign (1 bit), exponent (8), first mantissa bit (1)
NBUCKETS = 1 << (32 - KEY_SHIFT)
_KEY_OFFSET = NBUCKETS // 2  # the shift is arithmetic: negative floats give negative keys


@dataclass(frozen=True)
class Bucket:
    lo_mag: float  # smallest magnitude the bucket can hold (for min_nonzero); inf for none
    rep: float  # a value inside the bucket, used to classify it


def _float_of(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _bucket(key: int) -> Bucket:
    top = (key - _KEY_OFFSET) & (NBUCKETS - 1)  # the ten top bits of the float32 pattern
    negative, exponent, half = top >> 9, (top >> 1) & 0xFF, top & 1
    sign = -1.0 if negative else 1.0
    if exponent == 0xFF:  # inf (mantissa 0) or NaN (a quiet NaN has the first mantissa bit set)
        return Bucket(math.inf, math.nan if half else sign * math.inf)
    if exponent == 0 and not half:  # +-0 and float32 subnormals below 2^-127
        return Bucket(math.inf, 0.0)
    lo = abs(_float_of(top << KEY_SHIFT))
    hi = abs(_float_of((top + 1) << KEY_SHIFT))  # inf above the largest finite bucket
    return Bucket(lo, sign * (lo + hi) / 2 if hi != math.inf else sign * lo * 1.25)


BUCKETS = [_bucket(k) for k in range(NBUCKETS)]


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

def measurable(t) -> bool:
    # complex tensors are not floating point
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and t.device.type != "meta"


def _limit(device: torch.device) -> int:
    return SAMPLE_CPU if device.type == "cpu" else SAMPLE


def sample_stride(n: int, limit: int) -> int:
    """The stride of the evenly strided sample of a tensor of ``n`` values, at most ``limit`` of
    them: the smallest that fits, moved up to an odd number, and from 7 up to a prime. A stride
    that divides the size of the last dimension would see only a few of its channels (stride 64 on
    [tokens, 128] sees channels 0 and 64); a prime one walks through all of them."""
    s = -(-n // limit)
    if s <= 1:
        return 1
    s |= 1
    while s >= 7 and not _prime(s):
        s += 2
    return s


def spread_index(n: int, width: int, device: torch.device) -> torch.Tensor:
    """``width`` distinct flat indices spread over n values: i x s mod n, for a stride s from
    ``sample_stride`` with no factor in common with n (so no index comes twice). The first pass
    is an evenly strided sample; the last few indices wrap around to fill the row."""
    s = sample_stride(n, width)
    while math.gcd(s, n) != 1:
        s += 2
        while s >= 7 and not _prime(s):
            s += 2
    return torch.arange(width, dtype=torch.int64).mul_(s).remainder_(n).to(device)


def _prime(s: int) -> bool:
    return all(s % d for d in range(3, math.isqrt(s) + 1, 2))


def _memo(cache: dict, key, make, limit: int = 64):
    """``cache[key]``, made by ``make()`` when missing; a cache holding more than ``limit``
    entries is emptied first (a training step asks for the same few keys every time)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) > limit:
            cache.clear()
        hit = cache[key] = make()
    return hit


class Batch:
    """The tensors measured on one device during one step, reduced together.

    Measuring a tensor takes two ops: ``aminmax``, and a copy of its values (or of a sample of
    them) into its own row of a float32 block of ``width`` columns, zeros after the values (they
    are taken out of the counts again). Bucketing and counting run once
    per block, over all its rows at once; a block is counted as soon as it is full, so the
    copies held stay small (``HOLD`` values at most)."""

    HOLD = 1 << 22

    def __init__(self, device: torch.device, defer: bool = False) -> None:
        self.device = device
        self.width = _limit(device)
        self.reuse = device.type == "cpu"  # one block per device, used again each step (see _SPARE)
        # The tracer's CPU batch lives as long as the trace and counts later (``defer``): counting
        # has a fixed cost of a dozen ops, so its block holds many steps' rows and is counted when
        # full (``chunks``); ``rows()`` gives the extremes only, and the counts reach the
        # aggregates through ``CountSums.own``/``apply``. Rows have ids that grow over the trace.
        self.defer = defer and self.reuse
        self.row_width = 2 if self.defer else ROW  # values per tensor in rows(): with defer, min and max
        self.ids = 0  # rows added so far
        self.base = 0  # the id of the first row since the last rows()
        self.first = 0  # the id of the block's first row
        self.chunks: list[tuple[int, torch.Tensor]] = []  # (first id, [rows, NCOUNTS + 1]) counted
        self.gather = device.type == "cpu"  # samples through an index (the CPU) or a strided view
        self.extremes: dict[torch.dtype, list[torch.Tensor]] = {}  # per dtype: min, max, min, max, ...
        # on the CPU: per dtype, a reused [n, 2] buffer that aminmax writes tensor i's extremes into
        # (row i; rows of tensors of other dtypes are not read)
        self.ext: dict[torch.dtype, _Extremes] | None = {} if self.reuse else None
        self.dtypes: list[torch.dtype] = []  # of each tensor, in order
        self.block: torch.Tensor | None = None  # [cap, width] float32
        self.views: list[torch.Tensor] | None = None  # its rows, on the CPU
        self.heads: dict[tuple[int, int], torch.Tensor] = {}
        self.cap = 0
        self.used = 0  # rows of the block written
        self.pads: list[int] = []  # zeros after the values, per written row
        self.counted: list[torch.Tensor] = []  # [rows, formats x classes + 1] of earlier blocks
        # numel -> the stride of its sample, and its flat indices: spread (gather) or strided
        self.strides = _STRIDES.setdefault(self.width, {})
        self.index = _INDEXES.setdefault((self.device, self.width, "spread"), {})
        self.strided = _INDEXES.setdefault((self.device, self.width, "strided"), {})

    def __len__(self) -> int:
        return len(self.dtypes)

    def add(self, x: torch.Tensor) -> tuple[int, int]:
        """Measure ``x`` (detached, on this batch's device); returns (numel, values counted)."""
        dt = x.dtype
        if self.ext is not None:  # into a buffer made once: no new tensors, no stack at the end
            i = len(self.dtypes)
            ex = self.ext.get(dt)
            if ex is None or i >= ex.cap:
                ex = self.ext[dt] = _Extremes.get(self.device, dt, i + 1, ex)
            torch.aminmax(x, out=(ex.lo[i], ex.hi[i]))
        else:
            ext = self.extremes.get(dt)
            if ext is None:
                ext = self.extremes[dt] = []
            ext.extend(torch.aminmax(x))
        self.dtypes.append(dt)
        if self.block is None:
            self._new_block()
        views = self.views
        row = views[self.used] if views is not None else self.block[self.used]
        n, width = x.numel(), self.width
        if n <= width:
            m = n
            if m < width:
                if views is not None:  # a reused block: its rows' heads are views made once
                    head = self.heads.get((self.used, m))
                    if head is None:
                        if len(self.heads) > 8192:  # a deferred block lives as long as the trace
                            self.heads.clear()
                        head = self.heads[(self.used, m)] = row[:m]
                    row = head
                else:
                    row = row[:m]
            row.copy_(x if x.dim() == 1 else x.view(-1) if x.is_contiguous() else x.reshape(-1))
        elif self.gather:  # ``width`` values through a cached index: one op for float32
            index = self.index.get(n)
            if index is None:
                index = _memo(self.index, n, lambda: spread_index(n, width, self.device), limit=256)
            m = width
            if dt is torch.float32:
                torch.take(x, index, out=row)  # a copy: a later in-place change cannot alter it
            else:
                row.copy_(torch.take(x, index))
        else:  # a strided view: no index of ``width`` values to keep on the device
            s = _memo(self.strides, n, lambda: sample_stride(n, width), limit=256)
            m = -(-n // s)
            if x.is_contiguous():
                src = x.as_strided((m,), (s,))
            else:
                index = _memo(self.strided, n, lambda: torch.arange(0, n, s, device=self.device), limit=256)
                src = torch.take(x, index)
            (row if m == width else row[:m]).copy_(src)
        self.pads.append(width - m)
        self.used += 1
        self.ids += 1
        if self.used == self.cap:
            self._count_held()
        return n, m

    def _new_block(self) -> None:
        reuse = self.reuse
        cap = max(1, min(self.HOLD, _BLOCK["defer" if self.defer else reuse]) // self.width)
        spare = _SPARE.pop(self.device, None) if reuse else None
        if spare is not None and len(spare[0]) == cap:
            self.block, self.views, self.heads = spare
        else:
            with torch.inference_mode(False):  # a block made in an inference_mode loop is zeroed outside it
                self.block = torch.zeros(cap, self.width, dtype=torch.float32, device=self.device)
                self.views = list(self.block.unbind(0)) if reuse else None  # made once: the block serves again
            self.heads = {}  # (row, length) -> the row's first values, for short samples
        self.cap = cap

    def _count_held(self) -> None:
        if not self.used:
            return
        block = self.block if self.used == self.cap else self.block[:self.used]
        if self.defer:  # the block stays with this batch
            self.chunks.append((self.first, _classes(block, self.pads)))
            block.zero_()
            self.first += self.used
            self.used, self.pads = 0, []
            return
        self.counted.append(_classes(block, self.pads))
        if self.reuse:  # counted already (CPU ops are synchronous): zeroed, it serves again
            block.zero_()  # the rows written; the others were never touched
            _SPARE[self.device] = (self.block, self.views, self.heads if len(self.heads) < 4096 else {})
        self.block, self.views, self.used, self.pads = None, None, 0, []

    def rows(self) -> torch.Tensor:
        """ROW values per tensor, in the order they were added, as one flat vector on the device
        (with ``defer``: the two extremes of those added since the last call)."""
        if self.defer:
            return self._extremes_only()
        self._count_held()
        # float32 holds float16, bfloat16 and float32 extremes and the counts exactly
        kinds = self.extremes if self.ext is None else self.ext
        dtype = torch.float64 if torch.float64 in kinds and self.device.type != "mps" else torch.float32
        if self.ext is not None:
            mm = self._buffered(dtype)
        else:
            groups = [torch.stack(v) for v in self.extremes.values()]
            groups = [g if g.dtype is dtype else g.to(dtype) for g in groups]
            mm = groups[0] if len(groups) == 1 else torch.cat(groups).index_select(0, self._order())
        counted = self.counted[0] if len(self.counted) == 1 else torch.cat(self.counted)
        out = torch.cat([mm.view(-1, 2), counted if counted.dtype is dtype else counted.to(dtype)], dim=1).view(-1)
        if self.ext is not None:  # copied out above
            self._release_extremes()
        return out

    def _extremes_only(self) -> torch.Tensor:
        dtype = torch.float64 if torch.float64 in self.ext else torch.float32
        if not self.dtypes:
            return torch.zeros(0, dtype=dtype)
        out = self._buffered(dtype, fresh=True).view(-1)
        self._release_extremes()
        self.dtypes, self.base = [], self.ids
        return out

    def _release_extremes(self) -> None:
        """The per-dtype extremes buffers serve the next step (their values have been copied)."""
        for ex in self.ext.values():
            _Extremes.put_back(self.device, ex)
        self.ext = {}

    def counts_of(self, rid: int) -> list[float]:
        """The counts and smallest nonzero magnitude (NCOUNTS + 1 values) of the row with id ``rid``
        of a deferred batch, counted now if its block has not been."""
        if rid >= self.first:
            i = rid - self.first
            return _classes(self.block[i:i + 1], [self.pads[i]])[0].tolist()
        for first, counted in self.chunks:
            if first <= rid < first + len(counted):
                return counted[rid - first].tolist()
        raise KeyError(rid)  # pragma: no cover - applied chunks are only dropped after their step

    def take_chunks(self, finish: bool = False) -> list[tuple[int, torch.Tensor]]:
        """The counted blocks since the last call (with ``finish``, the rows held are counted
        first, and the block is given back)."""
        if finish:
            self._count_held()
            if self.block is not None:
                _SPARE[self.device] = (self.block, self.views, self.heads if len(self.heads) < 4096 else {})
                self.block, self.views = None, None
        chunks, self.chunks = self.chunks, []
        return chunks

    def _buffered(self, dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
        """[n, 2] extremes in the tensors' order, from the per-dtype buffers (a view of one of
        them unless ``fresh`` or the dtypes were mixed)."""
        n = len(self.dtypes)
        exs = list(self.ext.items())
        mm = exs[0][1].buf[:n].to(dtype, copy=fresh or len(exs) > 1)
        if len(exs) > 1:  # each dtype's rows from its own buffer
            key = tuple(self.dtypes)
            for dt, ex in exs[1:]:
                rows = _memo(_ORDERS, (key, dt), lambda: torch.tensor(
                    [i for i, d in enumerate(self.dtypes) if d is dt], dtype=torch.int64))
                mm.index_copy_(0, rows, ex.buf.index_select(0, rows).to(dtype))
        return mm

    def _order(self) -> torch.Tensor:
        """Where each (min, max) pair of the per-dtype stacks lands in the order of the tensors."""
        key = (tuple(self.dtypes), tuple(self.extremes), self.device)
        return _memo(_ORDERS, key, lambda: _to_device(torch.tensor(self._order_list(), dtype=torch.int64), self.device))

    def _order_list(self) -> list[int]:
        start, pos = {}, 0
        for d, v in self.extremes.items():
            start[d] = pos
            pos += len(v)
        seen = dict.fromkeys(self.extremes, 0)
        idx = []
        for d in self.dtypes:
            i = start[d] + seen[d]
            seen[d] += 2
            idx += [i, i + 1]
        return idx


class _Extremes:
    """A [cap, 2] buffer of one dtype on the CPU and the 0-d views of its two columns, kept from
    step to step: ``aminmax(x, out=(lo[i], hi[i]))`` makes no tensor and needs no stack."""

    __slots__ = ("buf", "lo", "hi", "cap")
    _spare: dict[tuple, "_Extremes"] = {}

    def __init__(self, dtype: torch.dtype, cap: int, device: torch.device, old: "_Extremes | None") -> None:
        with torch.inference_mode(False):  # kept for later steps, which may run outside inference mode
            self.buf = torch.zeros(cap, 2, dtype=dtype, device=device)
            if old is not None:
                self.buf[:old.cap].copy_(old.buf)
            self.lo = list(self.buf[:, 0].unbind(0))
            self.hi = list(self.buf[:, 1].unbind(0))
        self.cap = cap

    @classmethod
    def get(cls, device: torch.device, dtype: torch.dtype, need: int, old: "_Extremes | None") -> "_Extremes":
        """A buffer of at least ``need`` rows that holds what ``old`` held."""
        if old is None:
            old = cls._spare.pop((device, dtype), None)
            if old is not None and old.cap >= need:
                return old
            old = None  # a spare buffer held nothing of this step
        return cls(dtype, max(256, 1 << (need - 1).bit_length()), device, old)

    @classmethod
    def put_back(cls, device: torch.device, ex: "_Extremes") -> None:
        cls._spare[(device, ex.buf.dtype)] = ex


# values per block: reused on the CPU (True), fresh elsewhere, counted later (the tracer's CPU batch)
_BLOCK = {True: 1 << 16, False: 1 << 22, "defer": 1 << 18}

_SPARE: dict[torch.device, tuple] = {}  # a counted CPU block (zeroed) and its rows, for the next
#                                       step: a fresh one costs the host page faults every step
_ORDERS: dict[tuple, torch.Tensor] = {}


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied to ``device`` without making the host wait."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _classes(rows: torch.Tensor, pads: list[int]) -> torch.Tensor:
    """[k, formats x classes + 1] float32 on the device for a [k, width] float32 block whose row
    i holds a sample's values followed by ``pads[i]`` zeros: each sample's class counts for every
    format and the lower magnitude of its smallest nonzero bucket."""
    k, width = rows.shape
    device = rows.device
    luts = _luts(device)
    keys = bucket_keys(rows).view(-1)
    pair = luts.pair.index_select(0, keys).view(k, width).add_(_row_offsets(device, k))
    counts = _count(pair.view(-1), k * _NPAIRS).view(k, _NPAIRS)
    if any(pads):  # the padding is +0: zero in both formats
        counts[:, _ZERO_PAIR] -= _to_device(torch.tensor(pads, dtype=counts.dtype), device)
    counts = counts.view(k, len(CLASSES), len(CLASSES))
    lowest = luts.magnitude.index_select(0, luts.rank.index_select(0, keys).view(k, width).amin(dim=1))
    return torch.cat([counts.sum(dim=2), counts.sum(dim=1), lowest.unsqueeze(1)], dim=1)  # float32


_NPAIRS = len(CLASSES) ** 2
_ZERO_PAIR = CLASSES.index("zero") * (len(CLASSES) + 1)  # (float16 zero, bfloat16 zero)
_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _row_offsets(device: torch.device, k: int) -> torch.Tensor:
    """[k, 1] int32 on the device: each row's first pair index (row x pairs)."""
    have = _OFFSETS.get(device)
    if have is None or len(have) < k:
        rows = max(256, 1 << (k - 1).bit_length())
        have = _OFFSETS[device] = _to_device(
            torch.arange(0, rows * _NPAIRS, _NPAIRS, dtype=torch.int32).unsqueeze(1), device)
    return have[:k]


def bucket_keys(flat: torch.Tensor) -> torch.Tensor:
    """Each value's bucket, 0..NBUCKETS-1: the top bits of its float32 pattern (int32)."""
    bits = (flat if flat.dtype is torch.float32 else flat.to(torch.float32)).view(torch.int32)
    return torch.bitwise_right_shift(bits, KEY_SHIFT).add_(_KEY_OFFSET)


_INDEXES: dict[tuple, dict[int, torch.Tensor]] = {}  # (device, width, kind) -> numel -> its sample's indices
_STRIDES: dict[int, dict[int, int]] = {}  # width -> numel -> its sample's stride


def _count(idx: torch.Tensor, size: int, how: str | None = None) -> torch.Tensor:
    """Occurrences of each bucket index, without a host sync.

    CPU ``bincount`` is synchronous anyway; on accelerators ``bincount`` reads the maximum
    back to size its output, so a fixed-size ``index_add_`` is used instead. Under
    ``torch.use_deterministic_algorithms`` (where ``index_add_`` may refuse to run) the counts
    come from sorting the keys and finding each bucket's edges. ``how`` forces one of the
    three ("bincount", "index_add", "sort")."""
    if how is None:
        how = "bincount" if idx.device.type == "cpu" else \
            "sort" if torch.are_deterministic_algorithms_enabled() else "index_add"
    if how == "bincount":
        return torch.bincount(idx, minlength=size)
    if how == "sort":
        edges = torch.searchsorted(torch.sort(idx).values,
                                   torch.arange(size + 1, dtype=idx.dtype, device=idx.device))
        return edges.diff()
    ones = torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel())
    return torch.zeros(size, dtype=torch.int64, device=idx.device).index_add_(0, idx, ones)


NCLASSES = len(CLASSES)
FORMAT_NAMES = tuple(FORMATS)
NCOUNTS = len(FORMATS) * NCLASSES  # class counts per tensor: format-major, CLASSES order


def counts_to_classes(counts: list[float]) -> dict[str, dict[str, float]]:
    """format -> class -> count, from the flat count list."""
    return {name: dict(zip(CLASSES, counts[j * NCLASSES:(j + 1) * NCLASSES])) for j, name in enumerate(FORMAT_NAMES)}


def index_of(fmt: str, cls: str) -> int:
    return FORMAT_NAMES.index(fmt) * NCLASSES + CLASSES.index(cls)


class TensorSummary:
    """Host-side summary of one tensor. Its class counts are worked out when first read: most
    summaries are only added to a module's sums (``CountSums``), which reads the raw row."""

    __slots__ = ("dtype", "numel", "absmax", "vmin", "vmax", "min_nonzero", "sampled", "row", "scale", "fix",
                 "finite", "at", "src", "_counts")

    def __init__(self, dtype: str, numel: int, absmax: float, vmin: float, vmax: float, min_nonzero: float,
                 row: list[float], scale: float, sampled: bool, fix: bool, at: int = -1,
                 src: torch.Tensor | None = None) -> None:
        self.dtype = dtype
        self.numel = numel
        self.absmax = absmax
        self.vmin = vmin
        self.vmax = vmax
        self.min_nonzero = min_nonzero  # a lower bound, within a factor of two
        self.sampled = sampled
        self.row = row  # its ROW values as counted
        self.scale = scale  # values per value counted
        self.fix = fix  # the exact extremes correct the counts (NaN, inf or an overflow)
        # the extremes are exact: NaN and inf anywhere show up in them
        self.finite = not fix or (math.isfinite(vmin) and math.isfinite(vmax))
        self.at = at  # where the row starts in ``src``, the host copy of the transfer it came in
        self.src = src
        self._counts: list[float] | None = None

    @property
    def counts(self) -> list[float]:
        """Class counts, format-major (see NCOUNTS), for all ``numel`` values."""
        c = self._counts
        if c is None:
            c = self._counts = _counts(self)
        return c

    def extra(self) -> list[float] | None:
        """What the exact extremes add to the scaled counts of the row (None: nothing)."""
        if not self.fix:
            return None
        scale = self.scale
        return [c - r * scale for c, r in zip(self.counts, self.row[2:2 + NCOUNTS])]

    @property
    def overflow16(self) -> bool:
        """Some value is finite but past float16's range."""
        return self.fix and self.counts[_F16_OVERFLOW] > 0

    @property
    def classes(self) -> dict[str, dict[str, float]]:
        return counts_to_classes(self.counts)

    @property
    def nonfinite(self) -> dict[str, float]:
        c = self.counts
        return {"nan": c[0], "pinf": c[1], "ninf": c[2]}



class CountSums:
    """Class counts summed per aggregate (a module's forward or backward, a parameter), on the
    host as one float64 tensor. A step's summaries are added together, with a handful of ops
    over the step's transfer, instead of a Python loop over each tensor's counts."""

    def __init__(self) -> None:
        self.sums = torch.zeros(256, NCOUNTS, dtype=torch.float64)
        self.lowest = torch.full((256,), math.inf, dtype=torch.float64)  # smallest nonzero magnitude (deferred rows)
        self.n = 0
        self._own = _owners()  # deferred rows: id, slot, scale, absmax
        self._src: torch.Tensor | None = None  # the transfer the recorded rows are in
        self._layouts: dict[tuple, tuple] = {}
        self._slots: list[int] = []
        self._ats: list[int] = []
        self._scales: list[float] = []
        self._wide: list[tuple[int, float]] = []  # (entry, absmax) of finite rows past a format's range

    def slot(self) -> int:
        """A new aggregate's row."""
        if self.n == len(self.sums):
            self.sums = torch.cat([self.sums, torch.zeros_like(self.sums)])
            self.lowest = torch.cat([self.lowest, torch.full_like(self.lowest, math.inf)])
        self.n += 1
        return self.n - 1

    def add(self, slot: int, s: TensorSummary) -> None:
        self.put(slot, s.at, s.scale, s.src)

    def put(self, slot: int, at: int, scale: float, src: torch.Tensor, absmax: float = 0.0) -> None:
        """Add the counts of the row at ``at`` of ``src``, times ``scale``, to ``slot``; a finite
        row's ``absmax`` past a format's range corrects them (``correct``)."""
        if src is not self._src:
            self.fold()
            self._src = src
        if absmax >= _LOWEST_OVERFLOW:
            self._wide.append((len(self._slots), absmax))
        self._slots.append(slot)
        self._ats.append(at)
        self._scales.append(scale)

    def own(self, rid: int, slot: int, scale: float, absmax: float = 0.0) -> None:
        """Row ``rid`` of the deferred batch belongs to ``slot``: its counts, times ``scale``, and
        its smallest nonzero magnitude are added when its block has been counted (``apply``)."""
        rows, slots, scales, absmaxes = self._own
        rows.append(rid)
        slots.append(slot)
        scales.append(scale)
        absmaxes.append(absmax)

    def apply(self, batch: "Batch", folded: int, finish: bool = False) -> None:
        """Add the counts of the deferred batch's counted blocks to the rows' owners. Rows with
        ids below ``folded`` have all their owners (their step has been folded); a block holding
        later ones (a report asked for in the middle of a step, parameter gradients transferred
        before their step ends) is kept for the next call."""
        chunks = batch.take_chunks(finish)
        batch.chunks[:0] = [c for c in chunks if c[0] + len(c[1]) > folded]
        if not chunks or not self._own[0]:
            return
        lo, hi = chunks[0][0], chunks[-1][0] + len(chunks[-1][1])
        counted = chunks[0][1] if len(chunks) == 1 else torch.cat([c for _, c in chunks])
        own = self._own
        # a block holds the rows of many steps: its owners are selected with tensor ops over the
        # columns' buffers, not a Python pass over each row
        rows, slot, scale, absmax = (torch.frombuffer(col, dtype=dt).clone()
                                     for col, dt in zip(own, _OWN_DTYPES))
        ready = (rows >= lo) & (rows < hi)
        if bool(ready.all()):  # the usual case: all of them
            self._own = _owners()
        else:
            later = (rows >= hi).nonzero().view(-1).tolist()  # rows of the step still being counted
            self._own = _owners([[col[i] for i in later] for col in own])
            ready = ready.nonzero().view(-1)
            if not len(ready):
                return
            rows, slot, scale, absmax = (x.index_select(0, ready) for x in (rows, slot, scale, absmax))
        wide = (absmax >= _LOWEST_OVERFLOW).nonzero().view(-1)
        wide = list(zip(wide.tolist(), absmax.index_select(0, wide).tolist())) if len(wide) else []
        vals = counted.index_select(0, rows.sub_(lo)).to(torch.float64)
        counts = vals[:, :NCOUNTS].mul_(scale.unsqueeze(1))
        self.sums.index_add_(0, slot, correct(counts, wide))
        self.lowest.scatter_reduce_(0, slot, vals[:, NCOUNTS], "amin")

    def fold(self) -> None:
        """Add what ``add`` recorded, reading the rows from their transfer."""
        if not self._slots:
            return
        at, scales, slots = _memo(self._layouts, (tuple(self._ats), tuple(self._slots), tuple(self._scales)),
                                  self._layout, limit=16)  # a training step repeats the last one's
        self.sums.index_add_(0, slots, correct(self._src.take(at).to(torch.float64).mul_(scales), self._wide))
        self._src, self._slots, self._ats, self._scales, self._wide = None, [], [], [], []

    def _layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.tensor(self._ats, dtype=torch.int64).unsqueeze(1) + _COUNT_COLUMNS,
                torch.tensor(self._scales, dtype=torch.float64).unsqueeze(1),
                torch.tensor(self._slots, dtype=torch.int64))

    def take(self) -> tuple[list[list[float]], list[float]]:
        """Every aggregate's sums and smallest nonzero magnitude since the last ``take``."""
        self.fold()
        out, low = self.sums[:self.n].tolist(), self.lowest[:self.n].tolist()
        self.sums.zero_()
        self.lowest.fill_(math.inf)
        return out, low


_OWN_DTYPES = (torch.int64, torch.int64, torch.float64, torch.float64)


def _owners(cols=((), (), (), ())) -> tuple[array, ...]:
    """The columns of ``CountSums``' deferred rows (id, slot, scale, absmax), as flat buffers."""
    return tuple(array(code, col) for code, col in zip("qqdd", cols))


def correct(counts: torch.Tensor, wide: list[tuple[int, float]]) -> torch.Tensor:
    """Scaled class counts [rows, NCOUNTS] of finite tensors, corrected as ``_counts`` corrects
    a summary's: a row whose exact absmax (``wide``: (row, absmax)) is past a format's range has
    at least one value that overflows it, whatever its sample held."""
    if not wide:
        return counts
    for j, fmt in enumerate(FORMATS.values()):
        rows = [i for i, a in wide if a >= fmt.overflow]
        if not rows:
            continue
        idx = torch.tensor(rows, dtype=torch.int64)
        sub = counts.index_select(0, idx)
        o, n = j * NCLASSES + _OVERFLOW, j * NCLASSES + _NORMAL
        need = sub[:, o] < 1
        sub[:, n] = torch.where(need, (sub[:, n] - 1).clamp_(min=0.0), sub[:, n])
        sub[:, o] = torch.where(need, torch.ones_like(sub[:, o]), sub[:, o])
        counts.index_copy_(0, idx, sub)
    return counts


@dataclass(frozen=True)
class _Luts:
    pair: torch.Tensor  # bucket -> float16 class x len(CLASSES) + bfloat16 class
    rank: torch.Tensor  # bucket -> its magnitude rank (1..), NBUCKETS for zero, inf and NaN
    magnitude: torch.Tensor  # rank -> the bucket's lower magnitude; inf at NBUCKETS


_LUTS: dict[torch.device, _Luts] = {}


def _luts(device: torch.device) -> _Luts:
    return _memo(_LUTS, device, lambda: _make_luts(device))


def _make_luts(device: torch.device) -> _Luts:
    f16, b16 = (CLASS_OF[name] for name in FORMATS)
    pair = [a * len(CLASSES) + b for a, b in zip(f16, b16)]
    rank, magnitude = [NBUCKETS] * NBUCKETS, [math.inf] * (NBUCKETS + 1)
    for key, b in enumerate(BUCKETS):
        if 0 < b.lo_mag < math.inf:
            r = (key - _KEY_OFFSET) & (_KEY_OFFSET - 1)  # sign dropped: exponent and first mantissa bit
            rank[key] = r
            magnitude[r] = b.lo_mag
    return _Luts(*(torch.tensor(v, dtype=dt, device=device) for v, dt in (
        (pair, torch.int32), (rank, torch.int32), (magnitude, torch.float32))))


ROW = 2 + len(FORMATS) * len(CLASSES) + 1  # values per tensor in Batch.rows()


def summarise(dtype: str, row: list[float], numel: int, sampled_n: int, at: int = -1,
              src: torch.Tensor | None = None) -> TensorSummary:
    """Host-side summary of one tensor from its ROW values (at ``at`` in ``src``, the host copy
    of the step's transfer, when given)."""
    vmin, vmax = row[0], row[1]
    has_nan = vmin != vmin or vmax != vmax
    absmax = math.nan if has_nan else (vmax if vmax > -vmin else -vmin)
    return TensorSummary(dtype, numel, absmax, vmin, vmax, row[-1], row, numel / sampled_n if sampled_n else 1.0,
                         sampled_n < numel, has_nan or absmax >= _LOWEST_OVERFLOW, at, src)


class Measured:
    """The tensors of one transfer, by id. Most are finite (``clean``): the fold adds them from a
    tuple, ``(at, dtype name, numel, values counted, scale, absmax, smallest nonzero, row id)``,
    and makes no summary; one whose absmax is past a format's range (GradScaler's gradients) has
    its counts corrected where they are summed (``CountSums``, ``correct``). The others (``bad``:
    NaN or inf) get a ``TensorSummary`` at once; a clean one gets one only when it is asked for
    (``get``, ``[]``). A row id is the row's in the tracer's deferred CPU batch (``held``), whose
    counts come later, or -1."""

    __slots__ = ("bad", "clean", "asked", "values", "src", "held")

    def __init__(self, values: list[float], src: torch.Tensor | None, held: "Batch | None" = None) -> None:
        self.bad: dict[int, TensorSummary] = {}
        self.clean: dict[int, tuple] = {}
        self.asked: dict[int, TensorSummary] = {}  # summaries made for clean ones
        self.values = values
        self.src = src
        self.held = held

    def add(self, gid: int, dtype: str, at: int, numel: int, sampled_n: int, rid: int = -1) -> None:
        r = self.row(dtype, at, numel, sampled_n, rid)
        if type(r) is tuple:
            self.clean[gid] = r
        else:
            self.bad[gid] = r

    def row(self, dtype: str, at: int, numel: int, sampled_n: int, rid: int = -1) -> TensorSummary | tuple:
        """The row at ``at`` of ``values`` (ROW values; with a row id, the two extremes only): its
        tuple when it is clean, else its summary."""
        values = self.values
        vmin, vmax = values[at], values[at + 1]
        if -math.inf < vmin and vmax < math.inf:  # also False for NaN
            return (at, dtype, numel, sampled_n, numel / sampled_n if sampled_n else 1.0,
                    vmax if vmax > -vmin else -vmin, values[at + ROW - 1] if rid < 0 else math.inf, rid)
        return self.summary((at, dtype, numel, sampled_n, 0, 0, 0, rid))

    def summary(self, r: tuple) -> TensorSummary:
        at, dtype, numel, sampled_n = r[:4]
        rid = r[7]
        if rid < 0:
            return summarise(dtype, self.values[at: at + ROW], numel, sampled_n, at, self.src)
        row = self.values[at: at + 2] + self.held.counts_of(rid)  # its counts, now
        return summarise(dtype, row, numel, sampled_n, 0, torch.tensor(row, dtype=torch.float64))

    def get(self, gid: int, default=None):
        s = self.bad.get(gid)
        if s is None:
            s = self.asked.get(gid)
            if s is None:
                r = self.clean.get(gid)
                if r is None:
                    return default
                s = self.asked[gid] = self.summary(r)
        return s

    def __getitem__(self, gid: int) -> TensorSummary:
        s = self.get(gid)
        if s is None:
            raise KeyError(gid)
        return s

    def __contains__(self, gid: int) -> bool:
        return gid in self.clean or gid in self.bad

    def overflow16(self, gid: int) -> bool:
        """Some value is finite but past float16's range (absent: False)."""
        r = self.clean.get(gid)
        if r is not None:  # finite: the extremes say it
            return r[5] >= F16_LIMIT
        s = self.bad.get(gid)
        return s is not None and s.overflow16


def _counts(s: TensorSummary) -> list[float]:
    """The class counts of a summary: its row's, scaled to all its values, and corrected by the
    exact extremes (at least one NaN, inf or overflow when they show one)."""
    scale = s.scale
    counts = s.row[2:2 + NCOUNTS]
    if scale != 1.0:
        counts = [v * scale for v in counts]
    if s.fix:  # the exact extremes guarantee at least one when present
        vmin, vmax = s.vmin, s.vmax
        has_nan = vmin != vmin or vmax != vmax
        finite_max = max((abs(v) for v in (vmin, vmax) if not math.isnan(v) and not math.isinf(v)), default=0.0)
        for j, fmt in enumerate(FORMATS.values()):
            base = j * NCLASSES
            if finite_max >= fmt.overflow and counts[base + _OVERFLOW] < 1:  # its bucket straddles the threshold
                counts[base + _OVERFLOW] = 1.0
                counts[base + _NORMAL] = max(0.0, counts[base + _NORMAL] - 1.0)
            if has_nan and counts[base + _NAN] < 1:
                counts[base + _NAN] = 1.0
            if vmax == math.inf and counts[base + _PINF] < 1:
                counts[base + _PINF] = 1.0
            if vmin == -math.inf and counts[base + _NINF] < 1:
                counts[base + _NINF] = 1.0
    return counts


_NAN, _PINF, _NINF, _OVERFLOW, _NORMAL = (CLASSES.index(c) for c in ("nan", "pinf", "ninf", "overflow", "normal"))
_LOWEST_OVERFLOW = min(f.overflow for f in FORMATS.values())
_F16_OVERFLOW = index_of("float16", "overflow")
F16_LIMIT = FORMATS["float16"].overflow  # |x| at or past it is inf in float16
_COUNT_COLUMNS = torch.arange(2, 2 + NCOUNTS, dtype=torch.int64)  # where the counts are in a row
