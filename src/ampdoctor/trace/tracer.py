"""The runtime tracer: global module hooks, gradient hooks, loss and parameter-gradient probes and
GradScaler bookkeeping.

Statistics stay on the device during a step; when the step ends (an optimizer step or
``scaler.update()``, or, until an optimizer has stepped, each iteration of the script's loop) all
of them are copied to the host in one transfer and folded into per-module summaries (a finite
tensor from a tuple of its figures, one with NaN or inf from a ``TensorSummary``; on the CPU the
class counts follow a block of many steps at a time, see ``stats``). Names are resolved
from the script's module trees when a step ends (see ``naming``). Nothing the tracer does can
stop the traced program: an error inside the tracer is caught, reported once as a note, and
tracing stops while the program goes on. Every hook and patch is removed in ``__exit__``, also
when the traced code raises.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from ampdoctor.trace import params as pm
from ampdoctor.trace import stats as st
from ampdoctor.trace.formats import FORMATS, LOW_PRECISION
from ampdoctor.trace.naming import Namer, find_instances
from ampdoctor.trace.patches import Patches
from ampdoctor.trace.records import LossAgg, ModuleAgg, Origin, ParamAgg, StepRecord, add_counts, add_row_counts
from ampdoctor.trace.tensors import in_functorch_transform, on_gradient, skip_reason, tensors_in

__all__ = ["StopTracing", "Tracer", "tensors_in"]

try:
    _compiling = torch.compiler.is_compiling
except AttributeError:  # pragma: no cover - older torch
    def _compiling() -> bool:
        return False

_current_node = torch._C._current_autograd_node
_set_grad = torch._C._set_grad_enabled
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class StopTracing(BaseException):
    """Raised when ``max_steps`` steps have ended, to end the traced program."""


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dt: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


class _Call:
    """One module call: its key, the call that was running when it started, and the ids of the
    tensors it read and wrote."""

    __slots__ = ("key", "parent", "ins", "outs", "child_origin", "recompute", "replay", "top", "step", "born",
                 "seq", "gin", "cmp")

    def __init__(self, key: int, parent: "_Call | None", recompute: bool, step: int, born: int, seq: int) -> None:
        self.key = key
        self.seq = seq  # the order calls started in
        self.step = step
        self.born = born  # the flush count when it was made
        self.parent = parent
        self.ins: list[int] = []
        self.outs: list[int] = []
        self.child_origin = False  # a call inside it was an origin
        self.recompute = recompute  # a checkpoint recomputation during backward
        self.replay = None
        self.top = parent is None
        self.gin: list | None = None  # (tensor, id) of inputs with a grad_fn, until the call returns
        self.cmp = None  # with --compare: the RNG, autocast state and inputs just before the call


class Tracer:
    """Trace mixed-precision numerics of every ``nn.Module`` call inside the ``with`` block.

    >>> with Tracer() as t:
    ...     train()
    >>> report = t.report()
    """

    PARTIAL = 1 << 13  # measured tensors waiting in one step before they are counted early
    FORWARD_BATCH = 64  # forward-only steps (no optimizer, no backward) counted in one transfer
    KEEP_CALLS = 1 << 16  # module calls kept for the backward analysis of later steps
    CARRY = 8  # steps a call waits for its gradients

    def __new__(cls, *args, mode: str = "full", **kwargs):
        if mode == "watch":  # Tracer(mode="watch"): the always-on guard that traces from the first bad step
            from ampdoctor.trace.watch import Watcher
            return Watcher(*args, **kwargs)
        if mode != "full":
            raise ValueError(f"mode must be 'full' or 'watch', not {mode!r}")
        return super().__new__(cls)

    def __init__(self, target: str | None = None, *, grads: bool = True, ops: bool = False,
                 max_steps: int | None = None, first_step: int = 0, mode: str = "full",
                 compare: str | None = None) -> None:
        if target is not None and target not in FORMATS:
            raise ValueError(f"target must be one of {sorted(FORMATS)}, not {target!r}")
        if compare not in (None, "float32", "fp32"):
            raise ValueError(f"compare must be 'float32', not {compare!r}")
        self.compare = "float32" if compare else None
        self.target = target
        self.grads = grads
        self.ops = ops
        self.max_steps = max_steps
        # the number of the first step it sees (a trace started by watch mode in the middle of a run)
        self.first_step = first_step
        self.steps = first_step
        self.optimizer_steps = 0
        self.transfers = 0
        self.step_records: list[StepRecord] = []
        self.modules: dict[tuple[int, str], ModuleAgg] = {}
        self.params: dict[int, ParamAgg] = {}
        self._sums = st.CountSums()  # the class counts of both, added a step at a time (see settle)
        self.origins: list[Origin] = []
        self.loss = LossAgg()
        self.op_origin: dict | None = None
        self.scaler_meta: dict | None = None
        self.not_traced: set[str] = set()  # classes of modules that ran inside torch.compile
        self.compiled_in: set[int] = set()  # keys of the modules whose forward ran compiled code
        self.dtypes_seen: set[str] = set()
        self.skipped: dict[str, int] = {}  # kinds of tensors that were not measured -> count
        self.notes: dict[str, str] = {}
        self.namer = Namer()
        self.modules_ran = False
        self._patches = Patches(self)
        self._handles: list = []
        self._in_scaler_step = 0
        self._in_enabled_scaler_step = 0
        self._stack: list[_Call | None] = []
        self._active = False
        self._replayer = None
        self._comparer = None
        if self.compare:
            from ampdoctor.trace.compare import Comparer
            self._comparer = Comparer(self)
        self._optimizer_made = False
        self._probed = False  # a backward-origin probe was armed (without --ops)
        self._training: bool | None = None
        self._gid = 0
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, id of its statistics, made by a module)
        self._gid0 = 0  # ids up to this one were counted in an earlier transfer
        self._dirty = False  # something ran since the last step was counted
        self._open_grad = False  # a forward-only step returned tensors that need gradients
        self._carry_calls: list[_Call] = []
        self._carry_hooked: dict[int, tuple[int, list[_Call]]] = {}
        self._flushes = 0
        self._held: st.Batch | None = None  # the CPU's deferred batch (its counts come later)
        self._folded = 0  # its rows with smaller ids have all their owners
        self._reset_step()

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._handles.append(nn_module.register_module_forward_pre_hook(self._pre_hook))
        self._handles.append(nn_module.register_module_forward_hook(self._post_hook, with_kwargs=True,
                                                                    always_call=True))
        self._handles.append(optim_module.register_optimizer_step_pre_hook(self._optimizer_pre_hook))
        self._handles.append(optim_module.register_optimizer_step_post_hook(self._optimizer_hook))
        self._patches.install()
        if self.ops:
            from ampdoctor.trace.replay import Replayer
            self._replayer = Replayer(self)
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        if not self._handles:
            return
        was_active, self._active = self._active, False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._patches.remove()
        try:
            waiting = self._pending or self._calls or self._parts or self._param_rows or self._bwd
            if was_active and (waiting or self._dirty):
                self._flush(end_step=True, count=self._dirty, stop=False)
            if self.namer.pending:
                self.namer.resolve()
            self._count_held()
        except Exception as exc:  # never let the tracer's own bookkeeping fail the caller
            self._note_error(exc, "the last step")
        finally:
            self._reset_step()
            self._stack.clear()
            self._seen = {}
            self._carry_calls, self._carry_hooked = [], {}

    # -- never fail the traced program ------------------------------------------------------------
    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self._note_error(exc, getattr(fn, "__name__", "a hook").strip("_").replace("_", " "))
            return None

    def _note_error(self, exc: BaseException, where: str) -> None:
        if os.environ.get("AMPDOCTOR_DEBUG"):
            raise exc
        self._active = False
        self._stack.clear()
        self.notes.setdefault("error", f"not traced after step {self.steps}: the tracer failed in {where} "
                                       f"({type(exc).__name__}: {exc}); the script went on untraced")

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    # -- hooks -------------------------------------------------------------------------------
    def _pre_hook(self, module, args):
        if not self._active or self._comparer is not None and self._comparer.shadowing:
            return None
        if _compiling():  # inside torch.compile: reported as not traced, never baked into a graph
            self.not_traced.add(type(module).__name__)
            if self._stack and self._stack[-1] is not None:
                self.compiled_in.add(self._stack[-1].key)  # its submodules ran compiled, unseen
            return None
        try:
            if in_functorch_transform():
                self._stack.append(None)
                self._skip("modules inside torch.func transforms (vmap/grad)")
                return None
            self._enter_call(module, args)
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self._note_error(exc, f"the forward pre-hook of {type(module).__name__}")
        return None

    def _enter_call(self, module, args) -> None:
        recompute = _current_node() is not None  # forward hooks during backward: checkpoint recomputation
        stack = self._stack
        parent = None
        for c in reversed(stack):
            if c is not None:
                parent = c
                break
        key = self.namer.key(module, parent.key if parent is not None else None)
        if not stack and not recompute:
            self._top_start(key, module)
        call = _Call(key, parent, recompute, self.steps, self._flushes, self._gid)
        stack.append(call)
        if recompute:
            return
        self.modules_ran = self._dirty = True
        call.gin = self._measure_inputs(call, args, None)
        if self._replayer is not None:
            self._replayer.before(call, module, args)
        if self._comparer is not None and self._comparer.low_precision(module, args, None):
            self._comparer.before(call, module, args)

    def _post_hook(self, module, args, kwargs, output=None):  # no output when forward raised
        if not self._active or _compiling() or not self._stack or \
                self._comparer is not None and self._comparer.shadowing:
            return None
        try:
            if in_functorch_transform():
                if self._stack and self._stack[-1] is None:
                    self._stack.pop()
                return None
            call = self._stack.pop()
            if call is None:
                return None
            if call.recompute:
                self._recomputed(call, output)
                return None
            self._leave_call(call, module, args, kwargs, output)
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self._note_error(exc, f"the forward hook of {type(module).__name__}")
        return None

    def _measure_inputs(self, call: _Call, inputs, gin: list | None) -> list | None:
        """Measure a call's inputs; returns ``gin`` with the (tensor, id) of those with a grad_fn
        appended (a new list when there is one to add)."""
        measure = self._measure
        for t in tensors_in(inputs):
            gid = measure(t)
            if gid is not None:
                call.ins.append(gid)
                if t.grad_fn is not None:
                    if gin is None:
                        gin = []
                    gin.append((t, gid))
        return gin

    def _leave_call(self, call: _Call, module, args, kwargs, output) -> None:
        measure = self._measure
        gin, call.gin = call.gin, None
        if kwargs:
            gin = self._measure_inputs(call, kwargs, gin)
        grad_on = self.grads and torch.is_grad_enabled()
        wants_grad = False
        hook = self._hook
        for t in tensors_in(output):
            gid = measure(t, True)
            if gid is None:
                continue
            call.outs.append(gid)
            if grad_on and t.grad_fn is not None:  # never hook a parameter: hooks on leaves outlive the trace
                wants_grad = True
                hook(t, gid, call)
        if wants_grad:
            # the gradients flowing into its inputs tell whether its own backward went non-finite
            if gin:
                hooked = self._hooked
                for t, gid in gin:
                    if gid not in hooked and type(t) in _PLAIN:
                        hook(t, gid, None)
            self._grad_calls.append(call)
        self._calls.append(call)
        if self._replayer is not None:
            self._replayer.after(call, module, args, kwargs, output)
        if call.cmp is not None and output is not None:
            self._comparer.after(call, module, args, kwargs, output)
        if call.top:
            self._top_end(wants_grad)
        elif len(self._pending) >= self.PARTIAL:
            self._flush(end_step=False)

    def _recomputed(self, call: _Call, output) -> None:
        """A forward run again in backward (activation checkpointing). With reentrant
        checkpointing its first forward ran under no_grad, so only these outputs get gradients."""
        if not (self.grads and torch.is_grad_enabled()):
            return
        hooked = False
        for t in tensors_in(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and skip_reason(t) is None:
                gid = self._new_gid()
                call.outs.append(gid)
                self._hook(t, gid, call)
                hooked = True
        if hooked:
            self._grad_calls.append(call)

    def _new_gid(self) -> int:
        self._gid += 1
        return self._gid

    def _measure(self, t, made: bool = False) -> int | None:
        """The id of this tensor's statistics in the step, measuring it only once per version."""
        if not isinstance(t, torch.Tensor):
            return None
        # ``made``: a module returned it. That is remembered across steps (T5's encoder output read
        # by the decoder in the next forward-only step is not new data).
        seen = self._seen.get(id(t))  # measured before, so measurable
        if seen is None or seen[0]() is not t:
            seen = None
            reason = skip_reason(t)
            if reason is not None:
                if reason:
                    self._skip(reason)
                return None
        ver = None if t.is_inference() else t._version  # inference tensors have no version counter:
        if seen is not None:                             # they are measured each time they are seen
            if ver is not None and seen[1] == ver and seen[2] > self._gid0:
                gid = seen[2]  # measured in this transfer, unchanged since
                if made and not seen[3]:
                    self._seen[id(t)] = (seen[0], ver, gid, True)
                    self._out_gids.add(gid)
                return gid
            made = made or (seen[3] and seen[1] == ver)  # a module made it, in an earlier step
        gid = self._stage(t)
        try:
            self._seen[id(t)] = (weakref.ref(t), ver, gid, made)
        except TypeError:  # pragma: no cover - tensors that refuse weak references
            pass
        if made:
            self._out_gids.add(gid)
        return gid

    def _stage(self, t: torch.Tensor) -> int:
        if type(t) not in _PLAIN:  # a subclass without its own dispatch: measure its plain values
            with torch._C.DisableTorchFunctionSubclass():
                t = t.as_subclass(torch.Tensor)
        dev = t.device
        batch = self._batches.get(dev)
        if batch is None:
            batch = self._batch(dev)
        slot = len(batch.dtypes)
        if torch.is_grad_enabled():  # the measuring ops must not join the autograd graph
            _set_grad(False)
            try:
                n, sampled = batch.add(t)
            finally:
                _set_grad(True)
        else:
            n, sampled = batch.add(t)
        self._gid += 1
        self._pending.append((self._gid, _dtype_name(t.dtype), n, sampled, dev, slot))
        return self._gid

    def _batch(self, dev: torch.device) -> st.Batch:
        """This step's Batch for a device: on the CPU, the trace's one deferred batch."""
        batch = self._batches.get(dev)
        if batch is None:
            if dev.type == "cpu":
                if self._held is None:
                    self._held = st.Batch(dev, defer=True)
                batch = self._held
            else:
                batch = st.Batch(dev)
            self._batches[dev] = batch
        return batch

    def _hook(self, t: torch.Tensor, gid: int, owner: _Call | None) -> None:
        owners = self._hooked.get(gid)
        if owners is None:
            owners = self._hooked[gid] = []
            on_gradient(t, self._grad_hook(gid))
        if owner is not None:
            owners.append(owner)

    def _grad_hook(self, gid: int):
        def hook(grad):
            if self._active and grad is not None:  # None: an output the loss did not use
                try:
                    g = self._measure(grad)  # once: autograd hands the same tensor to both sides of a sum
                    if g is not None:
                        self._dirty = True
                        self._bwd.append((g, gid))
                        if self._replayer is not None:
                            self._replayer.grad(gid, grad)
                except (StopTracing, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    self._note_error(exc, "a gradient hook")
            return None
        return hook

    def _scaled_by_scaler(self, out) -> None:
        for t in tensors_in(out):
            self._scaled[id(t)] = weakref.ref(t)

    def _from_scaler(self, t) -> bool:
        ref = self._scaled.get(id(t))
        return ref is not None and ref() is t

    def _loss(self, tensors) -> None:
        self._dirty = self._backward_seen = True
        for t in tensors_in(tensors):
            if self._from_scaler(t):
                continue  # GradScaler.scale() output: its loss was measured unscaled
            gid = self._measure(t)
            if gid is not None:
                self._loss_gids.append(gid)

    def _grad_results(self, result, create_graph: bool, inputs=None, outputs=None) -> None:
        """What a top-level ``torch.autograd.grad`` returned. The gradients of parameters, without
        ``create_graph``, are a functional step's parameter gradients and are measured as such;
        the others (of inputs, or made for a gradient penalty) are checked as what the loss will
        be built on."""
        self._double_backward = self._double_backward or create_graph
        ins = [inputs] if isinstance(inputs, torch.Tensor) else \
            list(inputs) if isinstance(inputs, (list, tuple)) else []
        res = list(result) if isinstance(result, (list, tuple)) else [result]
        params = []
        for i, g in enumerate(res):
            p = ins[i] if len(ins) == len(res) else None
            if not create_graph and isinstance(p, torch.nn.Parameter) and isinstance(g, torch.Tensor):
                params.append((p, g))
                continue
            for t in tensors_in(g):
                gid = self._measure(t)
                if gid is not None:
                    self._gradres_gids.append(gid)
        if params:
            self._probe_pairs(params, any(self._from_scaler(t) for t in tensors_in(outputs)))
            for p, _ in params:
                self._grads_probed[id(p)] = weakref.ref(p)

    def _optimizer_pre_hook(self, optimizer, args, kwargs) -> None:
        self._updated = True
        if self._active and not self._in_enabled_scaler_step:
            self._guard(self._probe_params, optimizer, False)

    def _optimizer_hook(self, optimizer, args, kwargs) -> None:
        if not self._active or self._in_scaler_step:
            return  # inside scaler.step(): the scaler's update() ends this step
        self._end_step()

    def _before_unscale(self, scaler, optimizer) -> None:
        if not getattr(scaler, "_enabled", False):
            return
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
        stage = state.get("stage") if isinstance(state, dict) else None
        if stage is None or getattr(stage, "name", "READY") == "READY":
            self._probe_params(optimizer, True)

    def _after_backward(self) -> None:
        """No optimizer in this process (a hand-written update): the parameters' gradients are
        measured right after backward, before the update can use and clear them."""
        if self._expects_optimizer():
            return
        params, seen = [], set()
        for ref in self._tops.values():
            m = ref()
            if m is not None:
                for p in m.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        self._probe(params, False)

    def _probe_params(self, optimizer, scaled: bool) -> None:
        self._probe([p for group in optimizer.param_groups for p in group["params"]], scaled)

    def _probe(self, params, scaled: bool) -> None:
        pairs = []
        for p in params:
            g = getattr(p, "grad", None)
            if g is not None:
                ref = self._grads_probed.get(id(p))
                if ref is None or ref() is not p:  # measured already in this step, as autograd.grad returned it
                    pairs.append((p, g))
        self._probe_pairs(pairs, scaled)

    def _probe_pairs(self, pairs, scaled: bool) -> None:
        """Measure parameter gradients: (parameter, its gradient) pairs."""
        if not self.grads:
            return
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for p, g in pairs:
            if not isinstance(g, torch.Tensor) or skip_reason(g) is not None or g.is_inference():
                continue
            keys, grads = by_dev.setdefault(g.device, ([], []))
            keys.append(self.namer.param_key(p))
            grads.append(g.detach() if g.requires_grad else g)  # a graph: create_graph=True
        for dev, (keys, grads) in by_dev.items():
            dtypes = [_dtype_name(g.dtype) for g in grads]
            numels = [g.numel() for g in grads]
            batch = self._batch(dev)
            if batch.width == pm.SAMPLE:  # rows as wide as the module tensors': counted with them
                first = len(batch.dtypes)
                lengths = [batch.add(g)[1] for g in grads]
                self._param_rows.append((dev, first, ("params", keys, dtypes, numels, lengths, scaled)))
            else:
                flat, lengths = pm.measure(grads)
                self._parts.append((flat, ("params", keys, dtypes, numels, lengths, scaled)))

    def _scaler_before(self, scaler):
        if not getattr(scaler, "_enabled", False) or getattr(scaler, "_scale", None) is None:
            return None
        before = scaler._scale.detach().clone()
        infs = [f for state in scaler._per_optimizer_states.values()
                for f in state.get("found_inf_per_device", {}).values()]
        found = torch.stack([f.to(before.device).reshape(()) for f in infs]).sum() if infs else None
        return before, found

    def _scaler_after(self, scaler, before) -> None:
        before, found = before
        after = scaler._scale.detach().clone()
        z = torch.zeros((), device=before.device, dtype=before.dtype) if found is None else found
        flat = torch.stack([before.reshape(()).double(), z.reshape(()).double(), after.reshape(()).double()])
        self._parts.append((flat, ("scaler",)))
        self.scaler_meta = {"growth_interval": scaler._growth_interval, "growth_factor": scaler._growth_factor,
                            "backoff_factor": scaler._backoff_factor, "init_scale": scaler._init_scale}

    # -- steps ---------------------------------------------------------------------------------
    def _is_training(self) -> bool:
        """Whether steps end at the optimizer: it has stepped in this trace. Until then each
        forward pass is a step; those steps become step 0 when the first optimizer step ends
        (a dummy forward in ``__init__``, a sanity check before training)."""
        return self.optimizer_steps > 0

    def _expects_optimizer(self) -> bool:
        """Whether this process trains: an optimizer or GradScaler was made during the trace, or
        one is reachable from the script's variables. ``max_steps`` then counts optimizer steps."""
        if self._optimizer_made:
            return True
        if self._training is None:
            self._training = find_instances((torch.optim.Optimizer, torch.amp.GradScaler))
        return self._training

    def _top_start(self, key: int, module) -> None:
        if not self._is_training() and (self._backward_seen or key in self._tops):
            # no optimizer has stepped: a step is one iteration of the script's loop, and the next
            # one starts when a module already called at the top level is called again, or after
            # a backward (a hand-written update). A loss module or a second model called before
            # backward belongs to the same step.
            self._end_forward_step()
        if key not in self._tops:
            self._tops[key] = weakref.ref(module)

    def _end_forward_step(self) -> None:
        if self._open_grad or self._backward_seen:  # gradients: analyse the step now
            self._flush(end_step=True, count=True, stop=False)
        else:  # forward passes alone: the statistics of FORWARD_BATCH of them share one transfer
            self._fwd_batched += 1
            if self._fwd_batched >= self.FORWARD_BATCH or len(self._pending) >= self.PARTIAL:
                self._flush(end_step=True)
            self._count(stop=False)
        self._open_grad = self._backward_seen = False
        self._tops = {}
        if self.max_steps is not None and self.steps >= self.max_steps and not self._expects_optimizer():
            raise StopTracing()  # an evaluation script: max_steps counts its iterations

    def _top_end(self, wants_grad: bool) -> None:
        if not self._is_training():
            self._open_grad = self._open_grad or wants_grad
            return
        if len(self._pending) >= self.PARTIAL:
            self._flush(end_step=False)

    def _count(self, stop: bool = True) -> None:
        self._dirty = False
        self.steps += 1
        if stop and self.max_steps is not None and self.steps >= self.max_steps:
            raise StopTracing()

    def _rebase(self) -> None:
        """The first optimizer step: the forward-only steps before it become part of step 0."""
        self._open_grad = False
        first = self.first_step
        if self.steps == first:
            return
        self.steps = first
        for agg in self.modules.values():
            for name in ("nonfinite_steps", "origin_steps", "overflow_steps", "exceed_steps"):
                lst = getattr(agg, name)
                if lst:
                    lst[:] = [first]
        for o in self.origins:
            o.step = first
        if self.loss.nonfinite_steps:
            self.loss.nonfinite_steps[:] = [first]
        if self.loss.steps:
            self.loss.steps, self.loss.last = 1, first
        for rec in self.step_records:
            rec.step = first

    def _end_step(self) -> None:
        if not self._active:
            return
        if not self.optimizer_steps:
            self._rebase()
        self.optimizer_steps += 1
        if self._comparer is not None:
            self._comparer.optimizer_stepped()
        try:
            self._flush(end_step=True, count=True)
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self._note_error(exc, "the end of a step")

    # -- the one transfer per step -------------------------------------------------------------
    def _reset_step(self) -> None:
        self._pending: list[tuple] = []  # measured tensors: (id, dtype name, numel, values counted, device, slot)
        self._batches: dict[torch.device, st.Batch] = {}
        self._calls: list[_Call] = []
        self._grad_calls: list[_Call] = []
        self._hooked: dict[int, list[_Call]] = {}
        self._bwd: list[tuple[int, int]] = []  # (gradient's id, the id of the tensor it is the gradient of)
        self._parts: list[tuple] = []  # (flat device tensor, what it is)
        self._param_rows: list[tuple] = []  # (device, first slot, what): gradients measured in a Batch
        self._loss_gids: list[int] = []
        self._gradres_gids: list[int] = []  # what top-level torch.autograd.grad calls returned
        self._grads_probed: dict[int, weakref.ref] = {}  # the parameters whose gradients autograd.grad returned
        self._double_backward = False  # autograd.grad(create_graph=True) ran: gradients have a graph
        self._scaled: dict[int, weakref.ref] = {}  # the tensors GradScaler.scale() returned
        self._fin: dict[int, bool] = {}  # measured tensor id -> finite, for this step
        self._gfin: dict[int, bool] = {}  # tensor id -> its gradients were finite
        self._gorder: dict[int, int] = {}  # tensor id -> order its first non-finite gradient arrived in
        self._bwd_counted: set[int] = set()
        self._step_bad: dict[str, bool] = {"forward": False}
        self._out_gids: set[int] = set()  # tensors some module returned in this step
        self._step_params: list[tuple] = []
        self._step_scaler: list[tuple] = []
        self._fwd_batched = 0
        self._backward_seen = False
        self._step_fp16 = False
        self._updated = False  # an optimizer changed the weights in this step (it was not skipped)
        self._tops: dict[int, weakref.ref] = {}  # the modules called at the top level in this step

    def _transfer(self) -> st.Measured:
        pending, batches, parts, param_rows = self._pending, self._batches, self._parts, self._param_rows
        self._pending, self._batches, self._parts, self._param_rows = [], {}, [], []
        if not pending and not parts and not param_rows:
            return st.Measured([], None)
        flat = []
        start: dict[torch.device, int] = {}
        rid: dict[torch.device, int] = {}  # a deferred batch's first row id in this transfer
        width: dict[torch.device, int] = {}  # values per tensor
        pos = 0
        for dev in sorted(batches, key=str):
            batch = batches[dev]
            start[dev] = pos
            rid[dev] = batch.base if batch.defer else -1
            width[dev] = w = batch.row_width
            pos += len(batch) * w
            flat.append(batch.rows())
        extra_at, extra_rid = [], []
        for x, what in parts:
            extra_at.append((pos, st.ROW))
            extra_rid.append(-1)
            flat.append(x)
            pos += x.numel()
        for dev, first, what in param_rows:
            extra_at.append((start[dev] + first * width[dev], width[dev]))
            extra_rid.append(rid[dev] + first if rid[dev] >= 0 else -1)
            parts.append((None, what))
        if len({x.device for x in flat}) > 1:  # several devices: gather them on one first
            dev = sorted({x.device for x in flat}, key=str)[0]
            flat = [x.to(dev, non_blocking=True).double() for x in flat]
        elif any(x.dtype != flat[0].dtype for x in flat):
            flat = [x.double() for x in flat]
        host = torch.cat(flat)
        if host.device.type != "cpu":
            host = host.to("cpu")  # the single device-to-host transfer
        values = host.tolist()
        self.transfers += 1
        out = st.Measured(values, host, self._held)
        add, dtypes = out.add, set()
        for gid, dtype, numel, sampled, dev, slot in pending:
            r0 = rid[dev]
            add(gid, dtype, start[dev] + slot * width[dev], numel, sampled, r0 + slot if r0 >= 0 else -1)
            dtypes.add(dtype)
        self.dtypes_seen |= dtypes
        for (at, w), r0, (x, what) in zip(extra_at, extra_rid, parts):
            if what[0] == "scaler":
                self._step_scaler.append(tuple(values[at: at + x.numel()]))
            elif what[0] == "compare":
                self._comparer.fold(what[1], values[at: at + x.numel()])
            else:  # parameter gradients: rows of w values
                _, keys, dtypes, numels, lengths, scaled = what
                for i, key in enumerate(keys):  # a summary, or a clean one's tuple (Measured.add)
                    self._step_params.append((key, out.row(dtypes[i], at + i * w, numels[i], lengths[i],
                                                           r0 + i if r0 >= 0 else -1), scaled))
        return out

    def _flush(self, end_step: bool, count: bool = False, stop: bool = True) -> None:
        if self.namer.pending:
            self.namer.resolve()
        if self._comparer is not None:
            self._parts.extend(self._comparer.part() or ())
        summ = self._transfer()
        step = self.steps
        out_gids = self._out_gids
        for gid, s in summ.bad.items():  # a clean tensor is finite: missing from _fin means finite
            # -inf and finite values only, and no module made it: an additive attention mask
            # (generate_square_subsequent_mask), which makes no call's inputs non-finite
            self._fin[gid] = s.finite or (s.vmin == -math.inf and math.isfinite(s.vmax) and gid not in out_gids)
        self._fold_forward(step, summ)
        self._fold_backward(step, summ)
        self._gid0 = self._gid  # tensors measured before this transfer are measured again
        if not end_step:
            self._sums.fold()
            keep = {g for c in self._stack if c is not None for g in c.ins}
            self._fin = {g: self._fin[g] for g in keep if g in self._fin}
            return
        self._end_of_step(step, summ)
        if self._held is not None:  # every row so far has its owners now
            self._folded = self._held.ids
            self._sums.apply(self._held, self._folded)
        self._sums.fold()
        # calls whose gradients have not arrived yet (a GAN's generator, backward after the next
        # step) are kept for the next CARRY steps
        self._flushes += 1
        old = self._flushes - self.CARRY
        carry = [c for c in self._carry_calls + self._grad_calls
                 if c.born > old and any(g not in self._gfin for g in c.outs)]
        hooked = {g: (born, owners) for g, (born, owners) in self._carry_hooked.items()
                  if born > old and g not in self._gfin}
        hooked.update((g, (self._flushes - 1, owners)) for g, owners in self._hooked.items() if g not in self._gfin)
        if len(carry) > self.KEEP_CALLS:
            carry, hooked = [], {}
            self.notes.setdefault("calls", "some steps had too many module calls to keep for the backward "
                                           "analysis of a later step")
        self._reset_step()
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        self._carry_calls, self._carry_hooked = carry, hooked
        if self._replayer is not None:
            self._replayer.end_step()
        if count:
            self._count(stop)

    def _agg(self, key: int, phase: str) -> ModuleAgg:
        key = self.namer.canonical(key)
        agg = self.modules.get((key, phase))
        if agg is None:
            agg = self.modules[(key, phase)] = ModuleAgg(key, self.namer.mods[key].cls, phase,
                                                         slot=self._sums.slot())
        return agg

    def _fold_forward(self, step: int, summ: st.Measured) -> None:
        calls, self._calls = self._calls, []
        fin, sums = self._fin, self._sums
        clean, bad_rows = summ.clean, summ.bad
        now = step
        if fin:
            for c in calls:  # data that was NaN/Inf before any module touched it
                if c.parent is None and not self._step_bad["forward"]:
                    self._input_origin(c.step if c.step <= now else now, c)
        for c in calls:
            step = c.step if c.step <= now else now  # calls made before a rebase belong to step 0
            agg = self._agg(c.key, "forward")
            agg.calls += 1
            outs = None  # the summaries of its non-finite outputs
            wide = False  # a finite output past float16's range
            for g in c.outs:
                r = clean.get(g)
                if r is not None:
                    agg.add_row(r, step, sums, summ)
                    wide = wide or r[5] >= st.F16_LIMIT
                else:
                    s = bad_rows.get(g)
                    if s is not None:
                        agg.add(s, step, sums)
                        outs = [s] if outs is None else outs + [s]
            if outs is not None or wide:  # an output with NaN, inf or values past float16's range
                bad = [s for s in outs or () if not s.finite]
                if bad:
                    self._step_bad["forward"] = True
                    agg.mark(agg.nonfinite_steps, step)
                    if all(fin.get(g, True) for g in c.ins):
                        if c.parent is not None:
                            c.parent.child_origin = True
                        if not c.child_origin:
                            self._forward_origin(step, c, agg, bad, summ)
                if (wide or any(s.overflow16 for s in outs)) and \
                        not any(summ.overflow16(g) for g in c.ins):  # past fp16's range
                    agg.mark(agg.exceed_steps, step)
            if c.child_origin and c.parent is not None:
                c.parent.child_origin = True

    def _forward_origin(self, step: int, c: _Call, agg: ModuleAgg, bad: list, summ: st.Measured) -> None:
        agg.mark(agg.origin_steps, step)
        nan = any(s.nonfinite["nan"] for s in bad)
        low = [s.dtype for s in bad if s.dtype in LOW_PRECISION]
        overflow = not nan and bool(low)
        # a float32 input beyond the 16-bit output's range: the cast to that format (autocast's,
        # or the layer's own) made the inf, whatever the arithmetic after it produced
        cast_from = None
        if low and low[0] in FORMATS:
            limit = FORMATS[low[0]].max
            wide = [summ[g].absmax for g in c.ins if g in summ and summ[g].dtype not in LOW_PRECISION
                    and summ[g].finite and summ[g].absmax > limit]
            if wide:
                cast_from, overflow = max(wide), True
        if overflow:
            agg.mark(agg.overflow_steps, step)
        stored = self._stored_nonfinite(c.key)
        if stored:
            overflow = False  # the weights already held it: not this call's arithmetic
        op = None
        if self._replayer is not None and not stored:
            op = self._replayer.forward_origin(c)
        self._add_origin(Origin(step, "forward", agg.key, "overflow" if overflow else "nonfinite",
                                "nan" if nan else "inf", node=op, dtype=low[0] if low else bad[0].dtype, seq=c.seq,
                                stored=stored, cast_from=None if stored else cast_from))

    def _stored_nonfinite(self, key: int) -> list[str]:
        """The module's own parameters and floating buffers that hold NaN/Inf now (checked only
        for an origin, which is rare: one reduction and one host read per tensor)."""
        if self._updated:
            return []  # the weights were updated after the forward: they may hold what it made
        m = self.namer.mods.get(key)
        module = m.ref() if m is not None and m.ref is not None else None
        if module is None:
            return []
        out = []
        try:
            with torch.no_grad():
                for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    if t is not None and t.is_floating_point() and not skip_reason(t) \
                            and not bool(torch.isfinite(t).all()):
                        out.append(name)
        except Exception:  # a tensor subclass that cannot be reduced: no claim
            return []
        return out

    def _input_origin(self, step: int, c: _Call) -> None:
        """A top-level call given NaN/Inf that no module made: it came with the data, or from code
        between modules."""
        if any(not self._fin.get(g, True) and g not in self._out_gids for g in c.ins):
            self._step_bad["forward"] = True
            self._add_origin(Origin(step, "input", self.namer.canonical(c.key), "nonfinite", seq=c.seq))

    def _add_origin(self, o: Origin) -> None:
        if o.seq < 0:
            o.seq = self._gid + 1  # loss, backward and parameter origins: after the step's forward calls
        if len(self.origins) < 256:
            self.origins.append(o)

    def _fold_backward(self, step: int, summ: st.Measured) -> None:
        bwd, self._bwd = self._bwd, []
        hooked, carried = self._hooked, self._carry_hooked
        clean, bad_rows, sums = summ.clean, summ.bad, self._sums
        for g, tid in bwd:
            r = clean.get(g)
            if r is not None:
                s, ok, dtype = None, True, r[1]
            else:
                s = bad_rows.get(g)
                if s is None:
                    continue
                ok, dtype = s.finite, s.dtype
            if dtype == "float16":
                self._step_fp16 = True
            if tid in self._gfin:
                self._gfin[tid] = self._gfin[tid] and ok
            else:
                self._gfin[tid] = ok
            if not ok and tid not in self._gorder:
                self._gorder[tid] = len(self._gorder)
            owners = hooked.get(tid)
            if owners is None:
                owners = carried.get(tid, (0, ()))[1]
            done = set()
            for c in owners:
                key = self.namer.canonical(c.key)
                if key in done:
                    continue
                done.add(key)
                agg = self._agg(key, "backward")
                if key not in self._bwd_counted:
                    agg.calls += 1
                    self._bwd_counted.add(key)
                if s is None:
                    agg.add_row(r, step, sums, summ)
                else:
                    agg.add(s, step, sums)
                if not ok:
                    agg.mark(agg.nonfinite_steps, step)

    def _end_of_step(self, step: int, summ: st.Measured) -> None:
        # the loss
        loss_bad = False
        for gid in self._loss_gids:
            r = summ.clean.get(gid)
            if r is not None:  # finite: no summary needed
                dtype, absmax, ok = r[1], r[5], True
            else:
                s = summ.bad.get(gid)
                ok = self._fin.get(gid, True) if s is None else s.finite
                dtype, absmax = (None, math.nan) if s is None else (s.dtype, s.absmax)
            la = self.loss
            if dtype is not None:
                la.dtypes.add(dtype)
                if not math.isnan(absmax):
                    la.absmax = max(la.absmax, absmax)
                    la.nonzero = la.nonzero or absmax > 0
            if not ok:
                loss_bad = True
                ModuleAgg.mark(la.nonfinite_steps, step)
        if self._loss_gids and self.loss.last != step:  # steps with a loss (split steps count once)
            self.loss.steps += 1
            self.loss.last = step
        bad_rows = summ.bad  # the non-finite ones
        grad_bad = next((bad_rows[g] for g in self._gradres_gids if g in bad_rows and not bad_rows[g].finite), None)
        if grad_bad is not None and not self._step_bad["forward"]:
            # a gradient penalty or a double backward: its gradients were non-finite, and what the
            # loss made of them is not the loss code's doing
            self._add_origin(Origin(step, "backward", None, "nonfinite",
                                    "nan" if grad_bad.nonfinite["nan"] else "inf", dtype=grad_bad.dtype,
                                    via="autograd.grad"))
        elif loss_bad and not self._step_bad["forward"]:
            s = next((bad_rows[g] for g in self._loss_gids if g in bad_rows and not bad_rows[g].finite), None)
            self._add_origin(Origin(step, "loss", None, "nonfinite",
                                    "nan" if s is not None and s.nonfinite["nan"] else "inf",
                                    dtype=s.dtype if s is not None else None))
        # parameter gradients
        bad_params = []
        sums, fp16 = self._sums, False
        for key, s, scaled in self._step_params:
            pa = self.params.get(key)
            if pa is None:
                pa = self.params[key] = ParamAgg(key, slot=self._sums.slot())
            pa.steps += 1
            pa.scaled = pa.scaled or scaled
            if type(s) is tuple:  # finite: its Measured tuple
                dtype, a = s[1], s[5]
                pa.dtypes.add(dtype)
                fp16 = fp16 or dtype == "float16"
                pa.elements += s[2]
                if a > pa.absmax:
                    pa.absmax = a
                add_row_counts(pa, s, sums, summ)
                continue
            pa.dtypes.add(s.dtype)
            fp16 = fp16 or s.dtype == "float16"
            pa.elements += s.numel
            if math.isnan(s.absmax) or math.isnan(pa.absmax):
                pa.absmax = math.nan
            else:
                pa.absmax = max(pa.absmax, s.absmax)
            add_counts(pa, s, self._sums)
            if not s.finite:
                ModuleAgg.mark(pa.nonfinite_steps, step)
                bad_params.append(key)
        # activation gradients: the innermost call whose backward turned finite into non-finite
        grads_bad = not all(self._gfin.values())
        origin = None
        if grad_bad is not None:
            loss_bad = True  # the penalty explains what follows: no second origin for this step
        if grads_bad and not self._step_bad["forward"] and not loss_bad:
            origin = self._backward_origin(step)
        elif bad_params and not grads_bad and not self._step_bad["forward"] and not loss_bad:
            self._add_origin(Origin(step, "param", None, "nonfinite", params=bad_params[:16],
                                    via="double-backward" if self._double_backward else None))
        # the GradScaler
        for before, found, after in self._step_scaler:
            rec = StepRecord(step, before, after, bool(found > 0 or math.isnan(found)),
                             origin.key if origin is not None else None, bad_params[:16], grads_bad,
                             self._step_fp16 or fp16)
            self.step_records.append(rec)

    def _backward_origin(self, step: int) -> Origin:
        gfin, order = self._gfin, self._gorder
        cands = []
        for c in self._carry_calls + self._grad_calls:
            outs = [gfin[g] for g in c.outs if g in gfin]
            if not outs or not all(outs):
                continue
            bad = [order[g] for g in c.ins if gfin.get(g) is False]
            if bad:
                cands.append((min(bad), c))
        inner = {id(c) for _, c in cands}
        for _, c in cands:  # drop every candidate that contains another one
            p = c.parent
            while p is not None:
                inner.discard(id(p))
                p = p.parent
        cands = sorted((o, i, c) for i, (o, c) in enumerate(cands) if id(c) in inner)
        if not cands:
            o = Origin(step, "backward", None, "nonfinite")
        else:
            first, _, c = cands[0]
            also = []
            for o_, _, c2 in cands[1:]:
                k2 = self.namer.canonical(c2.key)
                if o_ == first and k2 != self.namer.canonical(c.key) and k2 not in also:
                    also.append(k2)
            o = Origin(step, "backward", self.namer.canonical(c.key), "nonfinite", also=also)
            agg = self._agg(c.key, "backward")
            agg.mark(agg.origin_steps, step)
            if self._replayer is not None and (self._replayer.only is None or o.key in self._replayer.only):
                o.node = self._replayer.backward_origin(c, [c2 for o_, _, c2 in cands if o_ == first])
                if self._replayer.only is not None:  # the probe's work is done
                    self._replayer = None
                    earlier = next((x for x in self.origins if x.phase == "backward" and x.key == o.key), None)
                    if earlier is not None and o.node and o.node.get("node"):
                        earlier.node = {**o.node, "seen_at": step}
            elif self._replayer is None and self.grads and not self._probed:
                # without --ops: keep this module's inputs from now on, to name the node if it happens again
                from ampdoctor.trace.replay import Replayer
                self._probed = True
                self._replayer = Replayer(self, only={o.key, *also})
        self._add_origin(o)
        return o

    # -- results --------------------------------------------------------------------------------
    def _count_held(self) -> None:
        """Count the rows the CPU's deferred batch holds, and give its block back."""
        if self._held is not None:
            self._sums.apply(self._held, self._folded, finish=True)

    def settle(self) -> None:
        """Move the summed class counts into the aggregates' own lists (before reading them)."""
        self._count_held()
        sums, lowest = self._sums.take()
        for agg in (*self.modules.values(), *self.params.values()):
            if agg.slot >= 0:
                agg.counts = [x + y for x, y in zip(agg.counts, sums[agg.slot])]
                if isinstance(agg, ModuleAgg) and lowest[agg.slot] < agg.min_nonzero:
                    agg.min_nonzero = lowest[agg.slot]

    def report(self) -> dict:
        from ampdoctor.trace.findings import build_report
        return build_report(self)
