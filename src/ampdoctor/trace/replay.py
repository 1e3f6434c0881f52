"""``--ops``: find the aten op that first produced a non-finite value.

With ``--ops`` the tracer keeps a copy of each module call's inputs and RNG state and, after
the call, checks (with a host sync: this is a debugging mode) whether finite inputs gave
non-finite outputs. The first such call is replayed once under a TorchDispatchMode that checks
every op's inputs and outputs. An op that writes an explicit ±inf (``masked_fill(mask, -inf)``,
``full(-inf)``) is an intentional mask, not an origin; a NaN that such a mask later causes (a
softmax over a fully masked row) is attributed to the op that produced the NaN, with a note.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_FILLS = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "where",
          "scalar_tensor", "index_put", "index_put_", "masked_scatter", "masked_scatter_", "copy_", "_to_copy",
          "clone", "lift_fresh", "detach", "view", "_unsafe_view", "expand", "t", "transpose", "permute",
          "reshape", "unsqueeze", "squeeze", "slice", "select", "contiguous", "alias"}


def _tensors(tree) -> list[torch.Tensor]:
    from ampdoctor.trace.tracer import tensors_in

    return [t for t in tensors_in(tree) if t.is_floating_point() and t.numel() > 0 and t.device.type != "meta"]


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
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if not outs:
            return out
        out_nan, out_inf = _state(outs)
        if not (out_nan or out_inf):
            return out
        in_nan, in_inf = _state(ins)
        intentional = name in _FILLS and _has_inf_scalar((args, kwargs))
        if out_inf and not in_inf and not out_nan and intentional:
            self.mask_ops.append(f"aten.{name}")
            return out
        if (out_nan and not in_nan) or (out_inf and not in_inf and not in_nan):
            note = None
            if out_nan and in_inf and self.mask_ops:
                note = f"its input held -inf/inf from {self.mask_ops[0]} (a mask); rows that are fully masked give NaN"
            self.origin = {"op": f"aten.{name}", "produced": "nan" if out_nan else "inf", "note": note}
        return out


class Replayer:
    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self.saved: list[tuple] = []
        self.done = False

    def before(self, module, args) -> None:
        if self.done:
            self.saved.append(None)
            return
        cloned = pytree.tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, args)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.saved.append((cloned, rng, cuda_rng))

    def after(self, module, args, kwargs, output, name: str) -> None:
        saved = self.saved.pop() if self.saved else None
        if self.done or saved is None:
            return
        cloned, rng, cuda_rng = saved
        ins = _tensors(cloned)
        outs = _tensors(output)
        if not outs or any(_state(ins)) or not any(_state(outs)):
            return
        self.done = True
        origin = self._replay(module, cloned, kwargs or {}, rng, cuda_rng)
        self.tracer.op_origin = {"module": name, "class": type(module).__name__, "step": self.tracer.steps,
                                 **(origin or {"op": None, "produced": None,
                                               "note": "the replay did not reproduce the non-finite value"})}

    def _replay(self, module, args, kwargs, rng, cuda_rng) -> dict | None:
        tracer = self.tracer
        tracer._active = False  # the replay's own module calls are not traced
        saved_rng = torch.get_rng_state()
        try:
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            mode = _OriginMode()
            with torch.no_grad(), mode:
                module(*args, **kwargs)
            return mode.origin
        except Exception as exc:  # a module that cannot be re-run on its inputs
            return {"op": None, "produced": None, "note": f"replay failed: {type(exc).__name__}: {exc}"}
        finally:
            torch.set_rng_state(saved_rng)
            tracer._active = True
