"""Parameter gradients, measured all at once right before the optimizer (or the GradScaler) uses them.

For the parameters of one device, a handful of fused ops, whatever their number: one
``_foreach_norm(inf)`` per dtype gives every gradient's exact absmax (NaN and inf included), and
one ``cat`` of an evenly strided view of each gradient (``SAMPLE`` values, no copy of the
gradient) is bucketed and counted like the module rows. The result is a [parameters, ROW]
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
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    absmax = torch.empty(len(grads), dtype=torch.float64, device=device)
    for idx in by_dtype.values():
        norms = torch._foreach_norm([grads[i] for i in idx], math.inf)
        vals = torch.stack([n.reshape(()) for n in norms]).to(torch.float64)
        if len(idx) == len(grads):
            absmax = vals
        else:
            absmax.index_copy_(0, st._to_device(torch.tensor(idx, dtype=torch.int64), device), vals)
    pieces, lengths = [], []
    pad = st._pad(device)[:SAMPLE]
    for g in grads:
        flat = _flat_sample(g)
        m = flat.numel()
        lengths.append(m)
        pieces.append(flat)
        if m < SAMPLE:
            pieces.append(pad[: SAMPLE - m])
    rows = torch.cat(pieces).to(torch.float32).view(len(grads), SAMPLE)
    classes = st._classes(rows, tuple(lengths))
    absmax = absmax.to(classes.dtype if device.type == "mps" else torch.float64).unsqueeze(1)
    out = torch.cat([-absmax, absmax, classes.to(absmax.dtype)], dim=1)
    return out.reshape(-1), lengths
