"""``--ops``: name the aten op (forward) or the autograd node (backward) that first produced a
non-finite value.

With ``--ops`` the tracer keeps, for each module call, a copy of its inputs (positional and
keyword), the RNG state and the autocast state from just before the call, and the gradients that
flowed into its outputs. After each call it checks, with a host sync (this is a debugging mode),
whether finite inputs gave non-finite outputs; the first such call is replayed once under a
TorchDispatchMode that checks every op. When a step's backward analysis names a module whose
backward turned finite gradients into non-finite ones, that call is replayed forward and
backward under anomaly mode, with a hook on every autograd node of the replayed graph, which
names the node (``SqrtBackward0``) and the forward line that created it.

A replay never touches the real run: it runs on a copy of the module that shares its
parameters and has its own copies of the buffers (a train-mode BatchNorm does not count a batch
twice), on copies of the inputs (a KV cache in the keyword arguments is not appended to twice),
and the RNG state is put back afterwards. An op that writes an explicit ±inf
(``masked_fill(mask, -inf)``) is an intentional mask, not an origin; a NaN that such a mask later
causes (a softmax over a fully masked row) is attributed to the op that produced the NaN, with a
note.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import re
import sys
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor.trace.tensors import skip_reason, tensors_in

_FILLS = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "where",
          "scalar_tensor", "index_put", "index_put_", "masked_scatter", "masked_scatter_", "copy_", "_to_copy",
          "clone", "lift_fresh", "detach", "view", "_unsafe_view", "expand", "t", "transpose", "permute",
          "reshape", "unsqueeze", "squeeze", "slice", "select", "contiguous", "alias"}
_CASTS = {"_to_copy", "to", "copy_", "_autocast_to_reduced_precision"}
# ops that return uninitialised memory: whatever bits it holds (NaN patterns included) are no result
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                  "resize_", "resize_as_", "set_"}
_NODE_LIMIT = 20_000


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tensors_in(tree) if skip_reason(t) is None]


def _state(ts: list[torch.Tensor]) -> tuple[bool, bool]:
    """(has NaN, has inf) over the tensors; syncs."""
    nan = any(bool(torch.isnan(t).any()) for t in ts)
    inf = any(bool(torch.isinf(t).any()) for t in ts)
    return nan, inf


def _has_inf_scalar(args) -> bool:
    for a in pytree.tree_leaves(args):
        if isinstance(a, float) and math.isinf(a):
            return True
        if isinstance(a, torch.Tensor) and a.numel() == 1 and a.is_floating_point() and bool(torch.isinf(a).all()):
            return True
    return False


class _OriginMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.origin: dict | None = None
        self.mask_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.origin is not None:
            return out
        name = func.overloadpacket.__name__
        if name in _UNINITIALISED:
            return out
        outs = _tensors(out)
        if not outs:
            return out
        out_nan, out_inf = _state(outs)
        if not (out_nan or out_inf):
            return out
        in_nan, in_inf = _state(_tensors((args, kwargs)))
        intentional = name in _FILLS and _has_inf_scalar((args, kwargs))
        if out_inf and not in_inf and not out_nan and intentional:
            self.mask_ops.append(f"aten.{name}")
            return out
        if (out_nan and not in_nan) or (out_inf and not in_inf and not in_nan):
            note = None
            if out_nan and in_inf and self.mask_ops:
                note = f"its input held -inf/inf from {self.mask_ops[0]} (a mask); rows that are fully masked give NaN"
            elif name in _CASTS and outs[0].dtype in (torch.float16, torch.bfloat16):
                note = (f"a cast to {str(outs[0].dtype).replace('torch.', '')} of values beyond its range: "
                        "autocast casts this op's weights and inputs")
            self.origin = {"op": f"aten.{name}", "produced": "nan" if out_nan else "inf", "note": note}
        return out


# -- copies that cannot reach back into the real run -----------------------------------------------
def unwrapped(fn):
    """The function under the tracers' wrappers (a replay is not the script's backward)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def external_grads(pairs: list) -> list:
    """What each output of a replayed call received from outside the call, as (output, gradient).

    ``pairs`` hold the replayed outputs and the gradients that flowed into the real ones. A hook
    on an output sees its whole gradient: what came from the code that used it after the call,
    and also what the call's other outputs sent back into it when one was computed from another
    (a model that returns its loss and the logits the loss came from). Fed back as is, that part
    would count twice. The outputs are solved from the last computed back: each one keeps its
    gradient less what the outputs computed from it send into it from their own. An output
    returned twice counts once; one left with no gradient is dropped."""
    seen, outs = set(), []
    for o, g in pairs:
        key = (id(o.grad_fn), o.output_nr) if o.grad_fn is not None else (id(o), -1)
        if key not in seen:
            seen.add(key)
            outs.append((o, g.to(o.dtype)))
    if len(outs) < 2:
        return outs
    index = {(id(o.grad_fn), o.output_nr): i for i, (o, _) in enumerate(outs) if o.grad_fn is not None}
    sources: list[set] = [set() for _ in outs]  # sources[i]: the outputs computed from output i
    for j, (o, _) in enumerate(outs):
        for i in _outputs_under(o.grad_fn, index):
            if i != j:
                sources[i].add(j)
    grad, own, done = unwrapped(torch.autograd.grad), [None] * len(outs), set()
    while len(done) < len(outs):
        ready = [i for i in range(len(outs)) if i not in done and sources[i] <= done]
        for i in ready or sorted(set(range(len(outs))) - done):  # (a graph has no cycle: never the second)
            o, total = outs[i]
            from_outputs = [j for j in sources[i] if own[j] is not None]
            if from_outputs:
                sent = grad([outs[j][0] for j in from_outputs], [o], [own[j] for j in from_outputs],
                            retain_graph=True, allow_unused=True)[0]
                if sent is not None:
                    wide = torch.promote_types(o.dtype, torch.float32)
                    total = (total.to(wide) - sent.to(wide)).to(o.dtype)
            own[i] = total if bool(total.count_nonzero()) else None
            done.add(i)
    return [(o, g) for (o, _), g in zip(outs, own) if g is not None]


def _outputs_under(root, index: dict) -> set:
    """The indices of ``index``'s (node id, output number) edges reachable from ``root``."""
    found, seen, todo = set(), set(), [root]
    while todo and len(seen) < 10 * _NODE_LIMIT:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, nr in node.next_functions:
            if nxt is not None:
                i = index.get((id(nxt), nr))
                if i is not None:
                    found.add(i)
                todo.append(nxt)
    return found


def _walk_tensors(obj, out: dict, depth: int = 0, budget: list | None = None) -> None:
    budget = budget if budget is not None else [10_000]
    if budget[0] <= 0 or depth > 5:
        return
    budget[0] -= 1
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), obj)
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type, torch.nn.Module)):
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        d = getattr(obj, "__dict__", None)
        items = list(d.values()) if isinstance(d, dict) else []
    for v in items:
        _walk_tensors(v, out, depth + 1, budget)


def clone_tree(obj, grad: bool = False):
    """A deep copy of a module call's arguments in which every tensor is a detached clone (which
    requires grad when ``grad`` and the original did)."""
    found: dict[int, torch.Tensor] = {}
    _walk_tensors(obj, found)
    memo: dict = {}
    for tid, t in found.items():
        c = t.detach().clone()
        if grad and t.requires_grad and c.is_floating_point():
            c.requires_grad_(True)
        memo[tid] = c
    memo[id(memo)] = list(found.values())  # keep the originals alive while copying
    return copy.deepcopy(obj, memo)


def copy_module(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module that shares its parameters and owns copies of its buffers and of its
    other state, so that running it changes nothing the real module holds."""
    memo: dict = {}
    for p in module.parameters():
        memo[id(p)] = p
    for b in module.buffers():
        memo[id(b)] = b.detach().clone()
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = v.detach()
    memo[id(memo)] = [module]
    return copy.deepcopy(module, memo)


def _rng():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@functools.cache
def _cuda_available() -> bool:
    """Asked once per process: the answer does not change, and each step's snapshot needs it."""
    return torch.cuda.is_available()


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    out = []
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not _cuda_available():
            continue
        try:
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - older torch
            pass
    return out


@contextlib.contextmanager
def _rng_as(state):
    """The RNG set to ``state`` (what ``_rng()`` returned) inside the block, and put back after."""
    now = _rng()
    try:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            torch.cuda.set_rng_state_all(now[1])


@contextlib.contextmanager
def _as_before(saved: "_Saved"):
    """RNG and autocast as they were just before the real call; the RNG is put back after."""
    with _rng_as(saved.rng), contextlib.ExitStack() as stack:
        for dev, enabled, dtype in saved.autocast:
            # no cast cache: a weight cast to float16 is cast again, so the replay sees that op
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield


@dataclasses.dataclass
class _Saved:
    module: "weakref.ref"
    args: object
    kwargs: dict
    rng: tuple
    autocast: list
    needs_grad: bool = False


def _call_kwargs() -> dict:
    """The keyword arguments of the module call whose forward pre-hook is running (the global
    pre-hook is not given them)."""
    f = sys._getframe(1)
    for _ in range(8):
        f = f.f_back
        if f is None:
            break
        if f.f_code.co_name == "inner" and f.f_code.co_filename.endswith("module.py"):
            kw = f.f_locals.get("kwargs")
            return kw if isinstance(kw, dict) else {}
    return {}


_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _forward_line(node) -> str | None:
    """The forward line that created an autograd node, from anomaly mode's record of it."""
    try:
        tb = node.metadata.get("traceback_")
    except Exception:
        return None
    if not tb:
        return None
    text = tb if isinstance(tb, str) else "".join(tb)
    frames = _TB_LINE.findall(text)
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    own = __file__.rsplit("/", 2)[0]
    user = [f for f in frames if not f[0].startswith(torch_dir) and not f[0].startswith(own)]
    if not user:
        return None
    path, line, fn, code = user[-1]
    return f"{path}:{line} in {fn}: {code.strip()}"


class Replayer:
    """With ``only`` (module keys), a probe: no forward replay, and inputs and gradients are kept
    for those modules' calls alone, so that a backward origin found without ``--ops`` can be
    named when the same module's backward goes non-finite again."""

    def __init__(self, tracer, only: set[int] | None = None) -> None:
        self.tracer = tracer
        self.only = only
        self.forward_done = only is not None
        self.forward_ops: dict[int, dict] = {}  # id(call) -> what the forward replay found
        self.grads: dict[int, torch.Tensor] = {}  # tensor id -> the gradient that flowed into it
        self.keep: set[int] | None = set() if only is not None else None  # tensor ids whose gradients to keep
        self.backward_done = False

    # -- during the run ----------------------------------------------------------------------------
    def before(self, call, module, args) -> None:
        if self.forward_done and self.backward_done:
            return
        if self.only is not None and self.tracer.namer.canonical(call.key) not in self.only:
            return
        try:
            kwargs = _call_kwargs()
            saved = _Saved(weakref.ref(module), clone_tree(args, grad=True), clone_tree(kwargs, grad=True), _rng(),
                           _autocast_state())
        except Exception as exc:  # inputs that cannot be copied: no replay for this call
            self.tracer.notes.setdefault("replay", f"--ops could not copy the inputs of a "
                                                   f"{type(module).__name__} call ({type(exc).__name__}: {exc})")
            return
        call.replay = saved

    def after(self, call, module, args, kwargs, output) -> None:
        saved = call.replay
        if saved is None:
            return
        saved.needs_grad = any(t.requires_grad for t in _tensors(output))
        if not saved.needs_grad or self.backward_done:
            call.replay = None  # nothing will flow back into it: drop the copies now
        elif self.keep is not None:
            self.keep.update(call.outs)
        if self.forward_done:
            return
        if not _tensors(output) or any(_state(_tensors((saved.args, saved.kwargs)))) \
                or not any(_state(_tensors(output))):
            return
        self.forward_done = True
        origin = self._replay_forward(module, saved)
        self.forward_ops[id(call)] = origin or {"op": None, "produced": None,
                                                "note": "the replay did not reproduce the non-finite value"}

    def grad(self, gid: int, grad: torch.Tensor) -> None:
        if not self.backward_done and (self.keep is None or gid in self.keep):
            self.grads[gid] = grad

    def end_step(self) -> None:
        self.grads.clear()
        if self.keep is not None:
            self.keep.clear()

    # -- what the tracer asks when a step ends -------------------------------------------------------
    def forward_origin(self, call) -> dict | None:
        return self.forward_ops.get(id(call))

    def backward_origin(self, call, candidates: list) -> dict | None:
        if self.backward_done:
            return None
        self.backward_done = True
        note = None
        for c in candidates or [call]:
            saved = c.replay
            if saved is None:
                note = note or "the inputs of that call were not kept"
                continue
            found = self._replay_backward(c, saved)
            if found and found.get("node"):
                found["candidate"] = c
                return found
            note = note or (found or {}).get("note")
        return {"node": None, "line": None, "note": note or "the replay did not reproduce the non-finite gradient"}

    # -- replays -------------------------------------------------------------------------------------
    def _replay_forward(self, module, saved: _Saved) -> dict | None:
        tracer = self.tracer
        tracer._active = False  # the replay's own module calls are not traced
        try:
            mod = copy_module(module)
            args, kwargs = clone_tree(saved.args), clone_tree(saved.kwargs)
            mode = _OriginMode()
            with _as_before(saved), torch.no_grad(), mode:
                mod(*args, **kwargs)
            return mode.origin
        except Exception as exc:  # a module that cannot be copied or re-run on its inputs
            return {"op": None, "produced": None, "note": f"replay failed: {type(exc).__name__}: {exc}"}
        finally:
            tracer._active = True

    def _replay_backward(self, call, saved: _Saved) -> dict | None:
        module = saved.module()
        if module is None:
            return {"note": "the module no longer exists"}
        grads = [self.grads.get(g) for g in call.outs]
        if not any(g is not None for g in grads):
            return {"note": "the gradients of its outputs were not kept"}
        tracer = self.tracer
        tracer._active = False
        try:
            mod = copy_module(module)
            args, kwargs = clone_tree(saved.args, grad=True), clone_tree(saved.kwargs, grad=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with _as_before(saved), torch.enable_grad(), torch.autograd.set_detect_anomaly(True, False):
                    out = mod(*args, **kwargs)
                    outs = _tensors(out)
                    pairs = external_grads([(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad
                                            and o.shape == g.shape])
                    if not pairs:
                        return {"note": "the replayed outputs need no gradient"}
                    found: dict = {}
                    handles = self._hook_nodes([o.grad_fn for o, _ in pairs if o.grad_fn is not None], found)
                    leaves = [t for t in tensors_in((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad
                              and t.grad_fn is None]
                    leaves += [p for p in mod.parameters() if p.requires_grad]
                    try:
                        torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
                    finally:
                        for h in handles:
                            h.remove()
            return found or {"note": "the replay did not reproduce the non-finite gradient"}
        except Exception as exc:
            return {"note": f"replay failed: {type(exc).__name__}: {exc}"}
        finally:
            tracer._active = True

    @staticmethod
    def _hook_nodes(roots: list, found: dict) -> list:
        handles, seen, todo = [], set(), list(roots)
        while todo and len(seen) < _NODE_LIMIT:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad":
                continue

            def hook(grad_inputs, grad_outputs, node=node):
                if found:
                    return None
                produced = [g for g in grad_inputs if isinstance(g, torch.Tensor) and g.is_floating_point()]
                incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor) and g.is_floating_point()]
                out_nan, out_inf = _state(produced)
                if (out_nan or out_inf) and not any(_state(incoming)):
                    found.update({"node": type(node).__name__, "produced": "nan" if out_nan else "inf",
                                  "line": _forward_line(node), "note": None})
                return None
            handles.append(node.register_hook(hook))
            todo.extend(n for n, _ in node.next_functions)
        return handles
