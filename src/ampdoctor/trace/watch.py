"""Watch mode: an always-on guard that costs almost nothing until a step goes wrong.

Per step it looks only at what the run computes anyway: whether the GradScaler skipped the
optimizer step (its own inf check decided that, and its own host sync told it) and whether the
loss was finite (one on-device comparison, read back without waiting: on CUDA through a
non-blocking copy into pinned memory, looked at once it has landed; a one-value loss already in
host memory is read where it is). Only the top-level modules have hooks, and nothing is copied
to the host in a step that is healthy.

It keeps, for the current step only, references to what a replay needs: the arguments of each
call of the script's top-level modules, the RNG and autocast state just before it, and, per
backward pass, the gradients that flowed into its outputs, except those of an output that only
the call itself used in that pass (the logits a model computed its own loss from). When a step
goes wrong (a non-finite loss; a skip that neither the scale's warm-up nor a growth of the scale
explains; the scale falling step after step) a full ``Tracer`` starts at once: the bad step's
calls are replayed under it (forward, and each backward pass with what came into the outputs
from outside the call, through ``torch.autograd.grad`` so that no ``.grad`` changes; the RNG
and the modules' buffers are put back afterwards), and the tracer then follows the run for
``trace_steps`` more steps. Its report names the origin as a full trace of that step would,
with the run's own step numbers.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field

import torch

from ampdoctor.trace import replay as rp
from ampdoctor.trace.naming import _find_roots as _script_modules
from ampdoctor.trace.patches import Swaps, scaler_classes
from ampdoctor.trace.tensors import on_gradient, skip_reason, tensors_in
from ampdoctor.trace.tracer import StopTracing, Tracer



_HOST_READABLE = (torch.float32, torch.float64, torch.float16)  # dtypes numpy reads
# the number the next autograd node will get on this thread (nodes are numbered as they are made)
_NEXT_NODE = getattr(torch._C._autograd, "_get_sequence_nr", None)


@dataclass
class _Snapshot:
    """One call of a top-level module in the current step."""

    module: "weakref.ref"
    args: tuple
    kwargs: dict
    rng: tuple
    autocast: list
    grad_enabled: bool
    # per backward pass of the step: {output index: the gradient that flowed into that output}
    grads: dict = field(default_factory=dict)
    versions: list = field(default_factory=list)  # the inputs' version counters at the call
    nodes: tuple = (0, 0)  # the numbers of the autograd nodes the call made: [first, end)
    outputs: int = -1  # how many output tensors (-1: the call has not returned)
    # per output: the passes in which only the call itself used it (its gradient is not kept then)
    internal: list = field(default_factory=list)
    later: list = field(default_factory=list)  # per output: a later top-level call was given it
    carried: bool = False  # kept from the step before: nothing had flowed back into it then


@dataclass
class _ScalerTrack:
    """What the host knows of a GradScaler without asking the device: which steps it skipped."""

    skips: int = 0  # consecutive skips
    warm: bool = False  # a step has succeeded: the warm-up back-off is over
    recent: list = field(default_factory=list)  # the steps it skipped after the warm-up, lately


class Watcher:
    """Watch a run for non-finite losses and unexplained GradScaler skips; trace fully from the
    first bad step on.

    >>> with Watcher() as w:
    ...     train()
    >>> w.report()["watch"]["trigger"]
    """

    MAX_GRAD_NUMEL = 1 << 26  # output gradients kept for a replay, per call (elements)
    MAX_WALK = 512  # autograd nodes made outside the calls, looked through per backward for the outputs used
    MAX_INNER = 64  # autograd nodes of a call, looked through from an output used for the outputs it came from
    MAX_CALLS = 16  # top-level calls kept per step
    WARMUP_SKIPS = 24  # back-offs at the start before the scale counts as collapsing (2**16 -> 2**-8)
    COLLAPSE_SKIPS = 3  # consecutive skips after the warm-up
    SKIP_WINDOW, WINDOW_SKIPS = 64, 8  # or this many skips within the last SKIP_WINDOW steps

    def __init__(self, target: str | None = None, *, grads: bool = True, ops: bool = False,
                 max_steps: int | None = None, trace_steps: int = 5) -> None:
        self.target, self.grads, self.ops, self.max_steps = target, grads, ops, max_steps
        self.trace_steps = trace_steps
        self.steps = 0  # steps watched (optimizer steps, skipped ones included)
        self.trigger: dict | None = None
        self.tracer: Tracer | None = None
        self.replayed: list[str] = []  # what the replay of the bad step could not do, or "ok"
        self.notes: dict[str, str] = {}
        self._swaps = Swaps()  # the wrapped GradScaler methods and autograd.backward
        self._handles: list = []
        self._active = False
        self._roots: dict[int, tuple["weakref.ref", list]] = {}
        self._searches = 0  # looks for the top-level modules, until they are found
        self._snaps: list[_Snapshot] = []
        self._outputs: dict[tuple, tuple] = {}  # (node number, output number) -> (snapshot, index): this step's
        self._pass = 0  # top-level backward passes (backward() and autograd.grad() calls) so far
        # host buffers the kept CPU gradients are copied into, the step's n-th into the n-th: holding
        # autograd's own buffer until the step ends keeps the allocator from reusing it, which
        # costs more on the CPU (a fresh block, page faults) than the copy
        self._buffers: list[torch.Tensor] = []
        self._buffered = 0
        self._backward_done = False  # a backward pass has ended since the first call of this step
        self._scalers: dict[int, _ScalerTrack] = {}
        self._in_enabled_scaler_step = 0  # inside an enabled GradScaler's step(): its update() ends the step
        self._stepped = False
        self._skipped = False
        self._scaled = False  # an enabled scaler stepped in this step: its update() ends the step
        self._loss_bad: torch.Tensor | None = None  # on the device: a non-finite loss was seen
        self._loss_host: list = []  # (pinned host copy, event) waiting to be read
        self._loss_cpu_bad = False  # a loss on the CPU was not finite (read at once: no device to wait for)
        self._replaying = False
        self._tracer_done = False

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "Watcher":
        from torch.optim import optimizer as optim_module

        self._handles.append(optim_module.register_optimizer_step_post_hook(self._optimizer_hook))
        for cls in scaler_classes():
            own = vars(cls)
            if "step" in own:
                self._swaps.set(cls, "step", self._wrap_step(own["step"]))
            if "update" in own:
                self._swaps.set(cls, "update", self._wrap_update(own["update"]))
        self._swaps.set(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self._swaps.set(torch.autograd, "grad", self._wrap_backward(torch.autograd.grad, grad=True))
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        self._active = False
        if self.tracer is not None:
            try:
                self.tracer.close()
            except Exception:  # pragma: no cover - Tracer.close never raises
                pass
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for _, handles in self._roots.values():
            for h in handles:
                h.remove()
        self._roots.clear()
        self._swaps.remove()
        self._snaps, self._outputs, self._buffers = [], {}, []

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self._active = False
            self.notes.setdefault("error", f"watch stopped after step {self.steps}: it failed "
                                           f"({type(exc).__name__}: {exc}); the script went on unwatched")
            return None

    # -- what runs every step --------------------------------------------------------------------
    def _wrap_backward(self, orig, grad: bool = False):
        """``torch.autograd.backward``, or with ``grad`` ``torch.autograd.grad`` (a functional
        training step, a gradient penalty; until the trigger only): the loss is checked (backward)
        or the top-level modules looked for (grad), and the outputs the pass goes through marked."""
        watcher = self

        def backward(*args, **kwargs):
            top = watcher._active and not watcher._replaying and torch._C._current_autograd_node() is None \
                and not (grad and watcher.trigger is not None)
            if top:
                roots = args[0] if args else kwargs.get("outputs" if grad else "tensors")
                if grad:
                    watcher._guard(watcher._find_roots)
                else:
                    watcher._guard(watcher._loss, roots)
                watcher._guard(watcher._backward_pass, roots)
            result = orig(*args, **kwargs)
            if top:
                watcher._backward_done = True
            if not grad and watcher._active and not watcher._replaying:
                watcher._guard(watcher._after_backward)
            return result
        backward.__wrapped__ = orig
        return backward

    def _wrap_step(self, orig):
        watcher = self

        def step(scaler, optimizer, *args, **kwargs):
            enabled = bool(getattr(scaler, "_enabled", False))
            watcher._in_enabled_scaler_step += enabled  # a disabled scaler's step is a plain one
            watcher._stepped = False
            try:
                result = orig(scaler, optimizer, *args, **kwargs)
            finally:
                watcher._in_enabled_scaler_step -= enabled
            if watcher._active and enabled:
                watcher._guard(watcher._scaler_stepped, scaler)
            return result
        return step

    def _wrap_update(self, orig):
        watcher = self

        def update(scaler, *args, **kwargs):
            result = orig(scaler, *args, **kwargs)
            if watcher._active and watcher._scaled:
                watcher._guard(watcher._end_step)
            return result
        return update

    def _optimizer_hook(self, optimizer, args, kwargs) -> None:
        self._stepped = True
        if self._active and not self._in_enabled_scaler_step and not self._scaled:
            self._guard(self._end_step)

    def _loss(self, tensors) -> None:
        self._find_roots()
        for t in tensors_in(tensors):
            if skip_reason(t) is not None or not t.is_floating_point():
                continue
            if t.dtype in _HOST_READABLE and t.device.type == "cpu" and t.numel() == 1:
                # a loss in host memory is read where it is (as the flag of a loss on a device is
                # once it has landed): no op, nothing to wait for
                self._loss_cpu_bad = self._loss_cpu_bad or not math.isfinite(t.detach().numpy().item())
                continue
            bad = torch.isfinite(t.detach()).logical_not().any()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad.logical_or(bad)

    def _after_backward(self) -> None:
        """Send the loss flag to the host without waiting; look at it once it has landed."""
        bad, self._loss_bad = self._loss_bad, None
        if bad is not None:
            if bad.device.type == "cuda":
                host = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(bad, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self._loss_host.append((host, ev))
            else:  # on the CPU (a loss the ops checked) the value is already here
                self._loss_host.append((bad, None))
        if self.trigger is None and self._loss_landed():
            self._trouble("the loss is not finite")

    def _loss_landed(self) -> bool:
        """Whether a loss read on the host, or a loss flag that has reached it, says non-finite
        (flags still on their way are looked at later)."""
        bad, waiting = self._loss_cpu_bad, []
        self._loss_cpu_bad = False
        for host, ev in self._loss_host:
            if ev is not None and not ev.query():
                waiting.append((host, ev))
                continue
            bad = bad or bool(host.numpy()) if host.device.type == "cpu" else bad
        self._loss_host = waiting
        return bad

    def _scaler_stepped(self, scaler) -> None:
        self._scaled = True
        track = self._scalers.get(id(scaler))
        if track is None:
            track = self._scalers[id(scaler)] = _ScalerTrack()
        if self._stepped:
            return
        # the scaler found inf/NaN gradients and skipped this optimizer step. One skip now and
        # then is the scaler doing its job (the scale had grown too large for the gradients);
        # skips that keep coming mean the scale is collapsing
        self._skipped = True
        recent = [s for s in track.recent if s > self.steps - self.SKIP_WINDOW] + [self.steps]
        reason = None
        if not track.warm:
            if track.skips + 1 >= self.WARMUP_SKIPS:
                reason = f"the GradScaler skipped the first {track.skips + 1} steps: the loss scale is collapsing"
        elif track.skips + 1 >= self.COLLAPSE_SKIPS:
            reason = f"the GradScaler skipped {track.skips + 1} steps in a row: the loss scale is collapsing"
        elif len(recent) >= self.WINDOW_SKIPS:
            reason = (f"the GradScaler skipped {len(recent)} of the last {self.SKIP_WINDOW} steps: the loss "
                      f"scale is falling")
        if reason is not None and self.trigger is None:
            self._trouble(reason)

    def _end_step(self) -> None:
        if self._scaled:
            for track in self._scalers.values():
                if self._skipped:
                    track.skips += 1
                    if track.warm:
                        track.recent = [s for s in track.recent if s > self.steps - self.SKIP_WINDOW]
                        track.recent.append(self.steps)
                else:
                    track.warm = True
                    track.skips = 0
        if self.trigger is None and self._loss_landed():
            self._trouble("the loss is not finite", replay=False)  # seen too late to replay: trace on
        self.steps += 1
        self._scaled = self._skipped = False
        # a call nothing has flowed back into yet (a GAN's generator, whose output the critic's
        # step saw detached) is kept for one more step: its backward may come in the next one
        self._snaps = [s for s in self._snaps if s.grad_enabled and s.outputs > 0 and not s.grads and not s.carried]
        for snap in self._snaps:
            snap.carried = True
        kept = {id(snap) for snap in self._snaps}
        self._outputs = {k: v for k, v in self._outputs.items() if id(v[0]) in kept}
        self._backward_done = False
        self._buffered = 0
        if self.tracer is not None and not self._tracer_done and self.tracer.optimizer_steps > self.trace_steps:
            self._tracer_done = True
            self.tracer._active = False  # its hooks go quiet now; they come off when the watch ends
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopTracing()

    # -- the top-level modules and their calls ---------------------------------------------------------
    def _find_roots(self) -> None:
        """At the first backward (and the next ones, up to 16, until some are found): the modules
        the script's variables hold that no other one contains. Their calls are what a replay runs
        again."""
        if self._roots or self._searches >= 16:
            return
        self._searches += 1
        found = [m for _, m in _script_modules(sys._getframe())]
        children = {id(c) for m in found for c in m.modules() if c is not m}
        for m in found:
            if id(m) in children or id(m) in self._roots:
                continue
            handles = [m.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True),
                       m.register_forward_hook(self._root_hook)]
            self._roots[id(m)] = (weakref.ref(m), handles)

    def _root_pre_hook(self, module, args, kwargs):
        if not self._active or self._replaying or torch._C._current_autograd_node() is not None:
            return None
        if self._backward_done and self.steps == 0 and not self._scaled:
            # no optimizer step yet, and a backward pass has ended: a loop with no optimizer (or the
            # first step of one with gradient accumulation) starts its next step here
            self._snaps, self._outputs, self._backward_done, self._buffered = [], {}, False, 0
        if len(self._snaps) < self.MAX_CALLS:
            if self._outputs:  # an earlier call's outputs may come in: they are used after that call
                self._guard(self._given, (args, kwargs))
            first = _NEXT_NODE() if _NEXT_NODE is not None else 0
            self._snaps.append(_Snapshot(weakref.ref(module), args, dict(kwargs), rp._rng(), rp._autocast_state(),
                                         torch.is_grad_enabled(), versions=_versions((args, kwargs)),
                                         nodes=(first, first)))
        return None

    def _root_hook(self, module, args, output):
        if not self._active or self._replaying or not self._snaps or not self.grads:
            return None
        snap = self._snaps[-1]
        if snap.module() is not module or not snap.grad_enabled or snap.outputs >= 0:
            return None  # not the call this snapshot is of (one past MAX_CALLS, or a nested call)
        outs = list(tensors_in(output))
        snap.outputs = len(outs)
        snap.internal, snap.later = [set() for _ in outs], [False] * len(outs)
        if _NEXT_NODE is not None:
            snap.nodes = (snap.nodes[0], _NEXT_NODE())
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.numel() <= self.MAX_GRAD_NUMEL:
                key = (t.grad_fn._sequence_nr(), t.output_nr)
                if key not in self._outputs:  # an output returned twice is kept once
                    self._outputs[key] = (snap, i)
                    on_gradient(t, self._keep(snap, i))
        return None

    def _keep(self, snap: _Snapshot, i: int):
        def hook(grad):
            try:
                if self._pass not in snap.internal[i] and grad is not None:
                    snap.grads.setdefault(self._pass, {})[i] = self._held(grad)
            except Exception:  # pragma: no cover - never into the script's backward
                pass
            return None
        return hook

    def _held(self, grad: torch.Tensor) -> torch.Tensor:
        """What to keep of a gradient until the step ends: on the CPU a copy in a buffer that
        serves again in the next step; elsewhere the gradient itself."""
        if grad.device.type != "cpu" or grad.layout != torch.strided or self._buffered >= self.MAX_CALLS * 4:
            return grad
        n, self._buffered = self._buffered, self._buffered + 1
        buf = self._buffers[n] if n < len(self._buffers) else None
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            with torch.inference_mode(False):
                buf = torch.empty_like(grad, memory_format=torch.contiguous_format)
            if n < len(self._buffers):
                self._buffers[n] = buf
            else:
                self._buffers.append(buf)
        return buf.copy_(grad)

    def _given(self, inputs) -> None:
        """A top-level call is given ``inputs``: the earlier calls' outputs that the tensors in
        them (in containers, or in the attributes of objects, such as a cache) were computed from,
        through code outside the calls, are used after those calls."""
        found: dict = {}
        rp._walk_tensors(inputs, found, budget=[256])
        for snap, i, _ in self._walk(list(found.values())) or ():
            snap.later[i] = True

    def _backward_pass(self, roots) -> None:
        """A backward pass starts from ``roots``. The outputs it reaches through code outside the
        calls are used after their call. An output that another output of the same call, one so
        reached, was computed from, and that nothing else is seen to use (the logits a model
        computed its own loss from), gets in this pass only what the call sent back into it: its
        gradient is not kept, and a replay gets it back through the call. Every other output's
        gradient is kept: code the walks cannot see (a tensor handed on inside an object, a
        module attribute) may have used it."""
        self._pass += 1
        if not self._outputs or _NEXT_NODE is None:
            return
        hits = self._walk(roots)
        if hits is None:
            return
        reached = {(id(snap), i) for snap, i, _ in hits}
        for snap, _, node in hits:
            others = {j for s, j in self._outputs.values() if s is snap and (id(snap), j) not in reached
                      and not snap.later[j]}
            for j in self._computed_from(snap, node, others):
                snap.internal[j].add(self._pass)

    def _walk(self, tensors) -> list | None:
        """The (snapshot, output index, its node) of this step's call outputs that ``tensors`` were
        computed from through nodes made outside the calls; None past ``MAX_WALK`` such nodes."""
        spans = [s.nodes for s in self._snaps]
        first = min(a for a, _ in spans) if spans else 0
        todo = [(t.grad_fn, t.output_nr) for t in tensors_in(tensors)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set = set()
        hits = []
        while todo:
            node, nr = todo.pop()
            number = node._sequence_nr()
            hit = self._outputs.get((number, nr))
            if hit is not None:
                hits.append((*hit, node))
                continue
            if id(node) in seen or not node.next_functions or number < first \
                    or any(a <= number < b for a, b in spans):
                continue  # a leaf's; made before this step's calls, or inside one
            seen.add(id(node))
            if len(seen) > self.MAX_WALK:
                return None
            todo.extend(edge for edge in node.next_functions if edge[0] is not None)
        return hits

    def _computed_from(self, snap: _Snapshot, node, among: set) -> list:
        """Those of ``snap``'s outputs ``among`` that the output made by ``node`` was computed
        from, found within ``MAX_INNER`` of the call's own nodes."""
        a, b = snap.nodes
        found, seen, todo = [], set(), [node] if among else []
        while todo and len(seen) < self.MAX_INNER and len(found) < len(among):
            n = todo.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            for nxt, nr in n.next_functions:
                if nxt is None:
                    continue
                number = nxt._sequence_nr()
                if not a <= number < b:
                    continue  # not the call's own: a leaf's, or made before the call
                hit = self._outputs.get((number, nr))
                if hit is not None and hit[0] is snap and hit[1] in among and hit[1] not in found:
                    found.append(hit[1])
                todo.append(nxt)
        return found

    # -- trouble -----------------------------------------------------------------------------------
    def _trouble(self, reason: str, replay: bool = True) -> None:
        self.trigger = {"step": self.steps, "reason": reason}
        self.tracer = Tracer(self.target, grads=self.grads, ops=self.ops, first_step=self.steps)
        # the scaler settled long before: its skips from here on are no warm-up
        self.tracer.scaler_warm = any(track.warm for track in self._scalers.values())
        self.tracer.__enter__()
        if not replay:
            self.replayed.append("the bad step was seen one step late (the loss flag was still on its way "
                                 "to the host): the steps after it are traced, not the step itself")
            return
        if not self._snaps:
            self.replayed.append("no call of a top-level module was seen in the bad step: the steps after "
                                 "it are traced, not the step itself")
            return
        for snap in self._snaps:
            self._replay(snap)

    def _replay(self, snap: _Snapshot) -> None:
        module = snap.module()
        if module is None:
            return
        if _versions((snap.args, snap.kwargs)) != snap.versions:
            self.replayed.append(f"the inputs of `{type(module).__name__}` were changed in place after its call "
                                 "(by the model or the script): its call was not replayed; the steps after it are "
                                 "traced")
            return
        saved = [(b, b.detach().clone()) for b in module.buffers()]
        self._replaying = True
        try:
            with rp._as_before(snap):
                # copies: a module that changes its inputs in place must not change the script's tensors
                args, kwargs = _copied((snap.args, snap.kwargs))
                with torch.set_grad_enabled(snap.grad_enabled):
                    out = module(*args, **kwargs)
                if snap.grad_enabled and snap.grads:
                    self._replay_backward(module, list(tensors_in(out)), snap.grads)
                elif snap.grad_enabled:
                    self.replayed.append(f"the gradients that flowed into `{type(module).__name__}`'s outputs "
                                         "were not kept: its forward was replayed, not its backward")
        except (StopTracing, KeyboardInterrupt):
            raise
        except Exception as exc:
            self.replayed.append(f"the replay of `{type(module).__name__}` failed ({type(exc).__name__}: {exc})")
        finally:
            self._replaying = False
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    def _replay_backward(self, module, outs: list, passes: dict) -> None:
        """The call's backward passes of the step, in their order, each fed what came into the
        outputs from outside the call in that pass."""
        params = [p for p in module.parameters() if p.requires_grad]
        grad = rp.unwrapped(torch.autograd.grad)
        for _, kept in sorted(passes.items()):
            pairs = [(outs[i], g) for i, g in kept.items()
                     if i < len(outs) and isinstance(outs[i], torch.Tensor) and outs[i].grad_fn is not None
                     and outs[i].shape == g.shape]
            if not pairs or not params:
                continue
            active, self.tracer._active = self.tracer._active, False  # it sees each pass once, below
            try:
                pairs = rp.external_grads(pairs)
            finally:
                self.tracer._active = active
            if pairs:
                grad([o for o, _ in pairs], params, grad_outputs=[g for _, g in pairs], allow_unused=True,
                     retain_graph=True)

    # -- the report --------------------------------------------------------------------------------
    @property
    def transfers(self) -> int:
        return self.tracer.transfers if self.tracer is not None else 0

    def report(self) -> dict:
        from ampdoctor import __version__
        from ampdoctor.trace.findings import build_report

        if self.tracer is not None:
            rep = build_report(self.tracer)
        else:
            rep = {"version": __version__, "target_dtype": self.target or "float16", "dtypes_seen": [],
                   "steps": 0, "optimizer_steps": 0, "transfers": 0, "modules_ran": False, "findings": [],
                   "first_nonfinite": None, "op_origin": None, "modules": [], "params": [], "loss": None,
                   "scaler": None, "not_traced": [], "skipped_tensors": {}, "notes": []}
        rep["steps"] = self.steps
        rep["notes"] = list(rep.get("notes", [])) + list(self.notes.values())
        traced = None
        if self.tracer is not None:
            first = self.trigger["step"] if self.trigger else 0
            traced = [first, first + max(0, self.tracer.optimizer_steps - 1)]
        rep["watch"] = {"steps_watched": self.steps, "trigger": self.trigger, "traced_steps": traced,
                        "replayed": self.tracer is not None and not self.replayed,
                        "replay_notes": self.replayed}
        return rep


def _copied(tree):
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def _versions(tree) -> list:
    out = []
    for t in tensors_in(tree):
        try:
            out.append(t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None)
        except Exception:  # pragma: no cover - a tensor subclass without a version counter
            out.append(None)
    return out
