"""Parameter gradients, measured all at once right before the optimizer (or the GradScaler) uses them.

For the parameters of one device, a handful of fused ops, whatever their number: one
``_foreach_norm(inf)`` per dtype gives every gradient's exact absmax (NaN and inf included; on the
CPU, where that op is slow, one ``aminmax`` per gradient gives the exact extremes), and
one ``cat`` of an evenly strided view of each gradient (at most ``SAMPLE`` values, no copy of
the gradient) is bucketed and counted like the module rows. The result is a [parameters, ROW]
block that joins the step's single transfer.
"""

from __future__ import annotations

import math

import torch

from ampdoctor.trace import stats as st

SAMPLE = 256


def _flat_sample(g: torch.Tensor) -> torch.Tensor:
    flat = g.view(-1) if g.is_contiguous() else g.reshape(-1)
    n = flat.numel()
    if n > SAMPLE:
        flat = flat[:: -(-n // SAMPLE)]
    return flat


def measure(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One device's gradients -> (flat device tensor of len(grads) * ROW values, values counted
    per gradient). All gradients must be on the same device."""
    device = grads[0].device
    if device.type == "cpu":  # the CPU's _foreach_norm(inf) is ten times slower than one aminmax each
        ext = torch.stack([torch.stack(torch.aminmax(g)).to(torch.float64) for g in grads])
    else:
        ext = torch.empty(len(grads), dtype=torch.float64, device=device)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            norms = torch._foreach_norm([grads[i] for i in idx], math.inf)
            vals = torch.stack([n.reshape(()) for n in norms]).to(torch.float64)
            if len(idx) == len(grads):
                ext = vals
            else:
                ext.index_copy_(0, st._to_device(torch.tensor(idx, dtype=torch.int64), device), vals)
        ext = torch.stack([-ext, ext], dim=1)  # absmax as (min, max): NaN and inf are exact
    pieces, lengths = [], []
    for g in grads:
        flat = _flat_sample(g)
        lengths.append(flat.numel())
        pieces.append(flat)
    classes = st._classes(torch.cat(pieces), tuple(lengths), device)
    ext = ext.to(classes.dtype if device.type == "mps" else torch.float64)
    out = torch.cat([ext, classes.to(ext.dtype)], dim=1)
    return out.reshape(-1), lengths
