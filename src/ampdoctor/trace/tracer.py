"""The runtime tracer: global module hooks, gradient hooks and GradScaler bookkeeping.

Statistics stay on the device during a step; at each optimizer step (or ``scaler.update()``)
all of them are copied to the host in one transfer and folded into per-module summaries.
Every hook and patch is removed in ``__exit__``, also when the traced code raises.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import dataclasses

from ampdoctor.trace import stats as st
from ampdoctor.trace.formats import FORMATS, LOW_PRECISION


def tensors_in(obj, depth: int = 0) -> list:
    """Every tensor in a module's inputs or outputs: tuples, lists, dicts (``ModelOutput`` too),
    dataclasses and namedtuples, to a bounded depth; anything else is skipped."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if isinstance(obj, (list, tuple)):
        if all(isinstance(v, torch.Tensor) for v in obj):  # the common case, without recursion
            return list(obj)
        return [t for v in obj for t in tensors_in(v, depth + 1)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v, depth + 1)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name, None), depth + 1)]
    return []


try:
    _compiling = torch.compiler.is_compiling
except AttributeError:  # pragma: no cover - older torch
    def _compiling() -> bool:
        return False


class StopTracing(BaseException):
    """Raised from the optimizer hook after ``max_steps`` steps to end the traced program."""


_DTYPE_NAMES: dict[torch.dtype, str] = {}


@dataclass(slots=True)
class _Pending:
    """One measured tensor waiting for the step's transfer."""

    module: str  # the first module that measured it
    cls: str
    role: str  # "input", "output" or "grad"
    dtype: str
    numel: int
    sampled: int
    device: torch.device
    slot: int  # its place in the device's batch


@dataclass
class ModuleAgg:
    """Everything seen for one (module, phase) over the run."""

    module: str
    cls: str
    phase: str
    dtypes: set[str] = field(default_factory=set)
    calls: int = 0
    absmax: float = 0.0
    min_nonzero: float = math.inf
    elements: float = 0.0
    classes: dict[str, dict[str, float]] = field(default_factory=lambda: {
        f: dict.fromkeys(st.CLASSES, 0.0) for f in FORMATS})
    nonfinite_steps: list[int] = field(default_factory=list)
    origin_steps: list[int] = field(default_factory=list)  # finite in, non-finite out
    overflow_steps: list[int] = field(default_factory=list)  # low-precision outputs overflowed to inf
    exceed_steps: list[int] = field(default_factory=list)  # outputs past fp16's range from inputs within it
    tensors_fp32: bool = False

    @staticmethod
    def mark(steps: list[int], step: int) -> None:
        if not steps or steps[-1] != step:
            steps.append(step)

    def add(self, s: st.TensorSummary) -> None:
        self.dtypes.add(s.dtype)
        if s.dtype not in LOW_PRECISION:
            self.tensors_fp32 = True
        if math.isnan(s.absmax):
            self.absmax = math.nan
        elif not math.isnan(self.absmax):
            self.absmax = max(self.absmax, s.absmax)
        self.min_nonzero = min(self.min_nonzero, s.min_nonzero)
        self.elements += s.numel
        for f, cl in s.classes.items():
            acc = self.classes[f]
            for k, v in cl.items():
                acc[k] += v


@dataclass
class StepRecord:
    step: int
    scale: float | None = None
    new_scale: float | None = None
    skipped: bool | None = None
    first_bad_grad: str | None = None


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


class _ScalerPatch:
    """Wraps GradScaler.step/update (and overrides in subclasses) for the duration of the trace."""

    def __init__(self, tracer: "Tracer") -> None:
        self.tracer = tracer
        self.originals: dict[type, dict[str, Any]] = {}
        self.depth = 0

    def install(self) -> None:
        base = torch.amp.GradScaler
        for cls in [base] + sorted(set(_subclasses(base)), key=lambda c: f"{c.__module__}.{c.__qualname__}"):
            own = {n: vars(cls)[n] for n in ("step", "update") if n in vars(cls)}
            if not own:
                continue
            self.originals[cls] = own
            if "step" in own:
                cls.step = self._wrap_step(own["step"])
            if "update" in own:
                cls.update = self._wrap_update(own["update"])

    def _wrap_step(self, orig):
        tracer = self.tracer

        def step(scaler, optimizer, *args, **kwargs):
            tracer._in_scaler_step += 1
            try:
                return orig(scaler, optimizer, *args, **kwargs)
            finally:
                tracer._in_scaler_step -= 1
        return step

    def _wrap_update(self, orig):
        tracer, patch = self.tracer, self

        def update(scaler, *args, **kwargs):
            if patch.depth:  # a subclass calling super().update(): the outer call records
                return orig(scaler, *args, **kwargs)
            patch.depth += 1
            try:
                before = found = None
                if getattr(scaler, "_enabled", False) and getattr(scaler, "_scale", None) is not None:
                    before = scaler._scale.detach().clone()
                    infs = [f for state in scaler._per_optimizer_states.values()
                            for f in state.get("found_inf_per_device", {}).values()]
                    if infs:
                        found = torch.stack([f.to(before.device).reshape(()) for f in infs]).sum()
                result = orig(scaler, *args, **kwargs)
                if before is not None:
                    tracer._scaler_state(scaler, before, found, scaler._scale.detach().clone())
            finally:
                patch.depth -= 1
            tracer._end_step()
            return result
        return update

    def remove(self) -> None:
        for cls, own in self.originals.items():
            for name, fn in own.items():
                setattr(cls, name, fn)
        self.originals.clear()


class Tracer:
    """Trace mixed-precision numerics of every ``nn.Module`` call inside the ``with`` block.

    >>> with Tracer() as t:
    ...     train()
    >>> report = t.report()
    """

    def __init__(self, target: str | None = None, *, grads: bool = True, ops: bool = False,
                 max_steps: int | None = None) -> None:
        if target is not None and target not in FORMATS:
            raise ValueError(f"target must be one of {sorted(FORMATS)}, not {target!r}")
        self.target = target
        self.grads = grads
        self.ops = ops
        self.max_steps = max_steps
        self.steps = 0
        self.step_records: list[StepRecord] = []
        self.modules: dict[tuple[str, str], ModuleAgg] = {}
        self.first_nonfinite: dict | None = None
        self.first_offender_calls: list[dict] = []
        self.op_origin: dict | None = None
        self.parents: dict[str, tuple[str, ...]] = {}
        self.scaler_meta: dict | None = None
        self.not_traced: set[str] = set()  # classes of modules that ran inside torch.compile
        self.dtypes_seen: set[str] = set()
        self.transfers = 0
        self._names: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()
        self._roots: list[str] = []
        self._handles: list = []
        self._scaler = _ScalerPatch(self)
        self._in_scaler_step = 0
        self._stack: list[list[int]] = []  # input records of the module calls in progress
        self._active = False
        self._replayer = None
        self._reset_step()

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._handles.append(nn_module.register_module_forward_pre_hook(self._pre_hook))
        self._handles.append(nn_module.register_module_forward_hook(self._post_hook, with_kwargs=True,
                                                                    always_call=True))
        self._handles.append(optim_module.register_optimizer_step_post_hook(self._optimizer_hook))
        self._scaler.install()
        if self.ops:
            from ampdoctor.trace.replay import Replayer
            self._replayer = Replayer(self)
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        if not self._active:
            return
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._scaler.remove()
        try:
            if self._pending or self._scaler_pending:
                self._flush()
                self.steps += 1  # work after the last optimizer step (or inference) counts as a step
        finally:
            self._reset_step()
            self._stack.clear()

    # -- naming ----------------------------------------------------------------------------
    def _name(self, module: torch.nn.Module) -> tuple[str, str]:
        hit = self._names.get(module)
        if hit is not None:
            return hit
        # an unseen module called at the top level is a new root: name its whole tree
        cls = type(module).__name__
        prefix = ""
        if self._roots:
            prefix = f"{cls}#{len(self._roots)}" if cls in self._roots else cls
        self._roots.append(cls)
        root_name = prefix or f"({cls})"
        for name, sub in module.named_modules():
            if sub in self._names:
                continue
            full = ".".join(p for p in (prefix, name) if p) or root_name
            self._names[sub] = (full, type(sub).__name__)
            parts = name.split(".") if name else []
            chain = [root_name] + [".".join(p for p in (prefix, ".".join(parts[:i])) if p) for i in range(1, len(parts))]
            self.parents[full] = tuple(c for c in chain if c != full)
        return self._names.get(module, (root_name, cls))

    # -- hooks -------------------------------------------------------------------------------
    @staticmethod
    def _in_backward() -> bool:
        # forward hooks that fire during backward are activation-checkpoint recomputations
        return torch._C._current_autograd_node() is not None

    def _pre_hook(self, module, args):
        if not self._active or self._in_backward():
            return None
        if _compiling():  # inside torch.compile: reported as not traced, never baked into a graph
            self.not_traced.add(type(module).__name__)
            return None
        name, cls = self._name(module)
        refs = [self._measure(t, name, cls, "input") for t in tensors_in(args) if st.measurable(t)]
        self._stack.append(refs)
        if self._replayer is not None:
            self._replayer.before(module, args)
        return None

    def _measure(self, t: torch.Tensor, name: str, cls: str, role: str) -> int:
        """Index of this tensor's statistics in the step, measuring it only once."""
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        self._pending.append(self._stage(t, name, cls, role))
        idx = len(self._pending) - 1
        try:
            self._seen[id(t)] = (weakref.ref(t), t._version, idx)
        except TypeError:  # pragma: no cover - tensors that refuse weak references
            pass
        return idx

    def _stage(self, t: torch.Tensor, name: str, cls: str, role: str) -> _Pending:
        dev = t.device
        batch = self._batches.get(dev)
        if batch is None:
            batch = self._batches[dev] = st.Batch(dev)
        slot = len(batch)
        n, sampled = batch.add(t)
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            dtype = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
        return _Pending(name, cls, role, dtype, n, sampled, dev, slot)

    def _post_hook(self, module, args, kwargs, output=None):  # no output when forward raised
        if not self._active or self._in_backward() or not self._stack or _compiling():
            return None
        inputs = self._stack.pop()
        name, cls = self._name(module)
        outs = []
        grad_on = self.grads and torch.is_grad_enabled()
        for t in tensors_in(output):
            if not st.measurable(t):
                continue
            idx = self._measure(t, name, cls, "output")
            outs.append(idx)
            if grad_on and t.requires_grad:
                owners = self._grad_owners.get(idx)
                if owners is None:
                    owners = self._grad_owners[idx] = []
                    t.register_hook(self._grad_hook(owners))
                owners.append((name, cls))
        self._calls.append((name, cls, inputs, outs))
        if self._replayer is not None:
            self._replayer.after(module, args, kwargs, output, name)
        return None

    def _grad_hook(self, owners: list):
        def hook(grad):
            if self._active and st.measurable(grad):
                name, cls = owners[0]
                self._pending.append(self._stage(grad, name, cls, "grad"))
                self._bwd.append((len(self._pending) - 1, tuple(owners)))
            return None
        return hook

    def _optimizer_hook(self, optimizer, args, kwargs) -> None:
        if not self._active or self._in_scaler_step:
            return  # inside scaler.step(): the scaler's update() ends this step
        self._end_step()

    def _scaler_state(self, scaler, before, found, after) -> None:
        self._scaler_pending.append((before, found, after))
        self.scaler_meta = {"growth_interval": scaler._growth_interval, "growth_factor": scaler._growth_factor,
                            "backoff_factor": scaler._backoff_factor, "init_scale": scaler._init_scale}

    def _end_step(self) -> None:
        if not self._active:
            return
        self._flush()
        self.steps += 1
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopTracing()

    # -- the one transfer per step -------------------------------------------------------------
    def _reset_step(self) -> None:
        self._pending: list[_Pending] = []
        self._batches: dict[torch.device, st.Batch] = {}
        self._calls: list[tuple] = []
        self._bwd: list[tuple] = []
        self._seen: dict[int, tuple] = {}
        self._grad_owners: dict[int, list] = {}
        self._scaler_pending: list[tuple] = []

    def _flush(self) -> None:
        pending, calls, bwd, scal, batches = self._pending, self._calls, self._bwd, self._scaler_pending, self._batches
        step = self.steps
        self._reset_step()
        if not pending and not scal:
            return
        parts = []
        start: dict[torch.device, int] = {}  # where each device's rows begin in the transfer
        pos = 0
        for dev in sorted(batches, key=str):
            start[dev] = pos
            parts.append(batches[dev].rows())
            pos += len(batches[dev]) * st.ROW
        for before, found, after in scal:
            z = torch.zeros((), device=before.device, dtype=before.dtype) if found is None else found
            parts.append(torch.stack([before.reshape(()).double(), z.reshape(()).double(), after.reshape(()).double()]))
        if len({x.device for x in parts}) > 1:  # several devices: gather them on one first
            dev = sorted({x.device for x in parts}, key=str)[0]
            parts = [x.to(dev, non_blocking=True).double() for x in parts]
        values = torch.cat(parts).tolist()  # the single device-to-host transfer of this step
        self.transfers += 1
        summaries: list[st.TensorSummary] = []
        for p in pending:
            at = start[p.device] + p.slot * st.ROW
            summaries.append(st.summarise(p.dtype, values[at: at + st.ROW], p.numel, p.sampled))
            self.dtypes_seen.add(p.dtype)
        rec = StepRecord(step)
        for _ in scal:
            rec.scale, found, rec.new_scale = values[pos: pos + 3]
            rec.skipped = bool(found > 0 or math.isnan(found))
            pos += 3
        self._fold(step, pending, summaries, calls, bwd, rec)
        if scal:
            self.step_records.append(rec)

    def _agg(self, name: str, cls: str, phase: str) -> ModuleAgg:
        agg = self.modules.get((name, phase))
        if agg is None:
            agg = self.modules[(name, phase)] = ModuleAgg(name, cls, phase)
        return agg

    def _fold(self, step, pending, summaries, calls, bwd, rec: StepRecord) -> None:
        for name, cls, ins, outs in calls:
            agg = self._agg(name, cls, "forward")
            agg.calls += 1
            for i in outs:
                agg.add(summaries[i])
            in_ok = all(summaries[i].finite for i in ins)
            bad = [summaries[i] for i in outs if not summaries[i].finite]
            if bad:
                agg.mark(agg.nonfinite_steps, step)
                if in_ok:
                    agg.mark(agg.origin_steps, step)
                    if all(not s.nonfinite["nan"] for s in bad) and any(s.dtype in LOW_PRECISION for s in bad):
                        agg.mark(agg.overflow_steps, step)
                    if self.first_nonfinite is None:
                        self.first_nonfinite = {"module": name, "class": cls, "phase": "forward", "step": step,
                                                "op": None}
            exceeds = lambda s: s.classes["float16"]["overflow"] > 0  # noqa: E731 - finite values past fp16's range
            if any(exceeds(summaries[i]) for i in outs) and not any(exceeds(summaries[i]) for i in ins):
                agg.mark(agg.exceed_steps, step)
        seen: set[str] = set()
        for idx, owners in bwd:
            s = summaries[idx]
            for name, cls in owners:
                agg = self._agg(name, cls, "backward")
                if name not in seen:
                    agg.calls += 1
                    seen.add(name)
                agg.add(s)
                if not s.finite:
                    agg.mark(agg.nonfinite_steps, step)
            if not s.finite and rec.first_bad_grad is None:
                name, cls = owners[0]  # the innermost module whose output this gradient belongs to
                rec.first_bad_grad = name
                self._agg(name, cls, "backward").mark(self._agg(name, cls, "backward").origin_steps, step)
                if self.first_nonfinite is None:
                    self.first_nonfinite = {"module": name, "class": cls, "phase": "backward", "step": step,
                                            "op": None}
        if self.op_origin is not None and self.first_nonfinite is not None and self.first_nonfinite["op"] is None \
                and self.op_origin.get("module") == self.first_nonfinite["module"]:
            self.first_nonfinite["op"] = self.op_origin["op"]

    # -- results --------------------------------------------------------------------------------
    def report(self) -> dict:
        from ampdoctor.trace.findings import build_report
        return build_report(self)

