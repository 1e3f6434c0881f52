"""``--compare fp32``: how many digits each layer loses against a float32 run of itself.

For every module call that runs in low precision (autocast is on for its device, or an input or
a parameter is float16/bfloat16), the module is run twice more right after the real call, under
``no_grad`` with autocast off:

- on float32 copies of the call's real inputs: the error of the real output against this is
  the error the layer adds itself (``own_rel_err``);
- on the float32 reference outputs of the layers before it (where an input is the output of an
  earlier compared call; else its float32 copy): the error against this is the error the output
  carries, its own and what it inherited (``rel_err``).

The errors are relative L2 norms, ``||y - y_ref|| / ||y_ref||``, kept on the device and copied to
the host with the step's one transfer. ``bits_correct`` is ``-log2(own_rel_err)``; ``bits_lost``
is how many of its format's bits (11 for float16, 8 for bfloat16) a layer loses itself beyond the
format's own rounding: the format's bits minus ``bits_correct``, at least 0. Layers are listed by
their own error; a container (a module whose own error is at most 8 times its worst child's) comes
after them, since its children explain it.

Nothing of the real run changes: the re-runs go through ``torch.func.functional_call`` with the
module's own parameters (float32 copies of 16-bit ones, made once per optimizer step) and copies
of its buffers, the RNG is set to its state just before the real call (the same dropout mask)
and put back after, and no module hook measures them. A parent module's re-run runs its whole
subtree again, so the overhead grows with the depth of the model (the README gives figures).
Gradients are not compared.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch.utils import _pytree as pytree

from ampdoctor.trace import replay as rp
from ampdoctor.trace.formats import FORMATS, LOSSY_BITS
from ampdoctor.trace.tensors import skip_reason, tensors_in

_LOW = (torch.float16, torch.bfloat16)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and skip_reason(t) is None


class Comparer:
    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self.shadowing = False  # a re-run is under way: the tracer's hooks stand aside
        self._refs: dict[int, tuple] = {}  # id(real output) -> (weakref, version, float32 reference)
        self._params32: dict[int, dict] = {}  # id(module) -> float32 copies of its 16-bit parameters
        self._pending: list[tuple[int, torch.Tensor]] = []  # (module key, [own, total] on the device)
        self.own: dict[int, list[float]] = {}  # module key -> own errors per call
        self.total: dict[int, list[float]] = {}  # module key -> errors per call
        self.skipped: dict[str, int] = {}

    # -- during the run --------------------------------------------------------------------------
    def before(self, call, module, args) -> None:
        """The state the re-runs start from, taken before the real call: the RNG and autocast
        state, float32 copies of the positional inputs and their float32 references. Taken now,
        not after the call, because a module may change its inputs in place (``x.add_(...)``,
        ``ReLU(inplace=True)``); keyword arguments reach only the post-hook and are taken there.
        The re-runs get copies only, never the run's own tensors, which an in-place module would
        change."""
        call.cmp = (rp._rng(), rp._autocast_state(), self._inputs(args))

    def _inputs(self, tree) -> tuple:
        """(float32 copies of the tensors in ``tree``, their references where known, else None)."""
        own = pytree.tree_map(lambda x: x.detach().to(torch.float32, copy=True) if _floating(x) else x, tree)
        ref = pytree.tree_map(self._ref_of, tree)
        return own, ref

    def _ref_of(self, x):
        """``x``'s float32 reference from the re-runs before, when ``x`` is unchanged since."""
        if not _floating(x):
            return None
        hit = self._refs.get(id(x))
        if hit is not None and hit[0]() is x and hit[1] == x._version:
            return hit[2]
        return None

    def low_precision(self, module, args, kwargs) -> bool:
        for dev, enabled, _ in rp._autocast_state():
            if enabled:
                return True
        for t in tensors_in((args, kwargs)):
            if _floating(t) and t.dtype in _LOW:
                return True
        return any(p.dtype in _LOW for p in module.parameters(recurse=False))

    def after(self, call, module, args, kwargs, output) -> None:
        saved = getattr(call, "cmp", None)
        call.cmp = None
        if saved is None:
            return
        outs = [t for t in tensors_in(output) if _floating(t)]
        if not outs:
            return
        rng, (own_pos, ref_pos) = saved[:2], saved[2]
        own_kw, ref_kw = self._inputs(kwargs)
        own_args, refs = (own_pos, own_kw), (ref_pos, ref_kw)
        used_ref = any(r is not None for r in pytree.tree_leaves(refs))
        ref_args = None
        if used_ref:  # where no reference is known, a copy of the input itself (made before any re-run)
            ref_args = pytree.tree_map(lambda r, o: r if r is not None else
                                       (o.clone() if isinstance(o, torch.Tensor) else o), refs, own_args,
                                       is_leaf=lambda x: x is None)
        try:
            y_own = self._rerun(module, own_args, rng)
            y_ref = self._rerun(module, ref_args, rng) if ref_args is not None else y_own
        except Exception as exc:  # a module that cannot run in float32 (an fp16-only kernel)
            reason = f"{type(module).__name__} ({type(exc).__name__})"
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
            return
        own_outs = [t for t in tensors_in(y_own) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        ref_outs = [t for t in tensors_in(y_ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if len(own_outs) != len(outs) or len(ref_outs) != len(outs):
            return
        errs = []
        for real, own, ref in zip(outs, own_outs, ref_outs):
            if real.shape != own.shape:
                return
            r = real.detach().float()
            errs.append(torch.stack([_rel(r, own), _rel(r, ref)]))
            try:
                self._refs[id(real)] = (weakref.ref(real), real._version, ref)
            except TypeError:  # pragma: no cover
                pass
        self._pending.append((call.key, torch.stack(errs).amax(0)))

    def _rerun(self, module, call_args, rng):
        args, kwargs = call_args
        state = {**self._params(module),
                 **{n: b.detach().clone().float() if b.is_floating_point() else b.detach().clone()
                    for n, b in module.named_buffers()}}
        self.shadowing = True
        try:
            with rp._rng_as(rng[0]), contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                for dev, _, dtype in rng[1]:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=False))
                return torch.func.functional_call(module, state, tuple(args), dict(kwargs), strict=False)
        finally:
            self.shadowing = False

    def _params(self, module) -> dict:
        """The module's parameters, 16-bit ones as float32 copies (made once per optimizer step)."""
        hit = self._params32.get(id(module))
        if hit is None:
            hit = {}
            for n, p in module.named_parameters():
                hit[n] = p.detach().float() if p.dtype in _LOW else p.detach()
            self._params32[id(module)] = hit
        return hit

    def optimizer_stepped(self) -> None:
        self._params32.clear()

    # -- the step's transfer ---------------------------------------------------------------------
    def part(self):
        """The step's errors as one flat device tensor for the tracer's transfer, and its keys."""
        pending, self._pending = self._pending, []
        self._refs = {k: v for k, v in self._refs.items() if v[0]() is not None} if len(self._refs) < 4096 else {}
        if not pending:
            return None
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for key, e in pending:
            keys, vals = by_dev.setdefault(e.device, ([], []))
            keys.append(key)
            vals.append(e)
        return [(torch.stack(vals).reshape(-1).double(), ("compare", keys)) for keys, vals in by_dev.values()]

    def fold(self, keys: list[int], values: list[float]) -> None:
        for i, key in enumerate(keys):
            own, total = values[2 * i], values[2 * i + 1]
            self.own.setdefault(key, []).append(own)
            self.total.setdefault(key, []).append(total)

    # -- the report ------------------------------------------------------------------------------
    def section(self, names: dict, canonical, mods: dict, target: str) -> dict:
        """Per layer, worst first: the layers that lose the most digits themselves, then the
        containers (whose own error is their children's)."""
        bits = _format(target).bits
        merged_own: dict[int, list[float]] = {}
        merged_total: dict[int, list[float]] = {}
        for key, vals in self.total.items():
            k = canonical(key)
            merged_total.setdefault(k, []).extend(vals)
            merged_own.setdefault(k, []).extend(self.own.get(key, []))
        own_of = {k: _median(merged_own.get(k, [])) for k in merged_total}
        # the largest own error among each module's compared children
        children: dict[int, float] = {}
        for k in merged_total:
            parent = mods[k].parent if k in mods else None
            if parent is not None:
                p = canonical(parent)
                children[p] = max(children.get(p, 0.0), _order(own_of[k]))
        rows = []
        for key, vals in merged_total.items():
            own = own_of[key]
            # a container whose own error its children explain; one that adds far more than they
            # do (code of its own forward between them) is ranked as a layer
            container = key in children and _order(own) <= 8 * children[key]
            row = {"module": names.get(key), "class": mods[key].cls if key in mods else None, "phase": "forward",
                   "calls": len(vals), "rel_err_median": _median(vals), "rel_err_max": max(vals),
                   "own_rel_err": own, "bits_correct": _correct(own), "bits_lost": _lost(own, bits),
                   "container": container}
            if not row["container"] and row["bits_lost"] and row["bits_lost"] >= LOSSY_BITS:
                row["advice"] = _advice(row, target)
            rows.append(row)
        rows.sort(key=lambda r: (r["container"], -_order(r["own_rel_err"]), -_order(r["rel_err_median"]),
                                 r["module"] or ""))
        out = {"reference": "float32", "format_bits": bits, "layers": rows}
        if self.skipped:
            out["not_compared"] = dict(sorted(self.skipped.items()))
        return out


def _format(target: str):
    """The format a trace judges against (float16 when it names none of the 16-bit ones)."""
    return FORMATS.get(target, FORMATS["float16"])


def _advice(row: dict, target: str) -> str:
    name, fmt = row["module"], _format(target)
    return (f"`{name}` loses {row['bits_lost']:g} of {fmt.name}'s {fmt.bits} bits itself: run "
            f"it in float32 (wrap the call in `torch.autocast(..., enabled=False)` and give it `.float()` "
            f"inputs); if it sums, averages or normalises many values, upcast that reduction"
            + (" (bfloat16 keeps even fewer bits: it helps range, not precision)" if fmt.name == "float16" else "")
            + ".")


def _rel(real: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||real - ref|| / ||ref||; 0 when both are zero, inf when only the reference is."""
    num = torch.linalg.vector_norm(real - ref)
    den = torch.linalg.vector_norm(ref)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.where(num > 0, torch.full_like(num, math.inf), torch.zeros_like(num)))


def _median(vals: list[float]) -> float | None:
    clean = sorted(v if not math.isnan(v) else math.inf for v in vals)
    if not clean:
        return None
    return clean[len(clean) // 2]


def _correct(rel: float | None) -> float | None:
    """The bits of the output that agree with float32: -log2 of the relative error."""
    if rel is None:
        return None
    if rel <= 0:
        return 24.0
    if math.isinf(rel) or math.isnan(rel):
        return 0.0
    return round(min(24.0, max(0.0, -math.log2(rel))), 1)


def _lost(rel: float | None, bits: int) -> float | None:
    """The bits of its format the layer loses itself, beyond the format's own rounding."""
    correct = _correct(rel)
    return None if correct is None else round(max(0.0, bits - correct), 1)


def _order(x: float | None) -> float:
    return -1.0 if x is None else (1e308 if math.isinf(x) or math.isnan(x) else x)
