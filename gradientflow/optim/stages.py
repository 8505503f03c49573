"""The StageGens of one uncompressed partition: dense average, sparse allgather.

Each is a generator in the engine's multi-stage contract (gradientflow.engine.stages): it yields
tensors to be SUM-allreduced in place and returns the result, so it runs unchanged on the
engine's thread, synchronously on a plain gloo group, or N-ranks-in-one-process under
`drive_lockstep` in the tests. (A compressed partition is a part of its compressor's fused op:
gradient_reducer._fuse.) None of them writes a parameter: the optimizer reads gradients
before and writes results after, so what crosses threads is only these tensors (and, under
momentum correction, the parameters' values the weight decay reads, unchanged until the step).

A used-flag per segment travels with the gradients (one extra element per segment at the end of
the dense buffer, one small stage of a compressed batch): a parameter that got no gradient on
any rank keeps `grad = None`, as DDP's find_unused_parameters leaves it, instead of receiving a
zero that momentum or weight decay would act on.
"""
from __future__ import annotations

from typing import Sequence

import torch

from gradientflow.engine.stages import StageGen

__all__ = ["dense_average", "fill_flat", "sparse_allgather"]


def fill_flat(inputs: Sequence[torch.Tensor | None], numels: Sequence[int], dtype: torch.dtype,
              device: torch.device, extra: int, buffer: torch.Tensor | None = None,
              scale: float = 1.0) -> torch.Tensor:
    """`inputs` back to back in one flat tensor (None: zeros), times `scale`, with `extra`
    elements left after them; into `buffer` when it has the size and dtype."""
    size = sum(numels) + extra
    if buffer is not None and buffer.numel() == size and buffer.dtype == dtype:
        flat = buffer  # reused every step: a fresh allocation costs page faults per step
    else:
        flat = torch.empty(size, dtype=dtype, device=device)
    off = 0
    for g, n in zip(inputs, numels):
        dst = flat[off:off + n]
        off += n
        if g is None:
            dst.zero_()
            continue
        src = g.reshape(-1)
        if src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype and src.is_contiguous():
            # The gradient already lives here (it points into last step's result, and backward
            # accumulated into it): a copy onto itself would be one more pass for nothing.
            if scale != 1.0:
                dst.mul_(scale)
        elif scale != 1.0:
            torch.mul(src, scale, out=dst)  # copy and scale in one pass
        else:
            dst.copy_(src)
    return flat


def dense_average(inputs: Sequence[torch.Tensor | None], numels: Sequence[int],
                  dtype: torch.dtype, device: torch.device, prescale: float,
                  postscale: float, buffer: torch.Tensor | None = None) -> StageGen:
    """Sum `inputs` (None: no gradient here) over ranks in one stage; return (flat, used flags).

    The flat result holds every segment back to back, scaled by prescale * postscale; used[i] says
    whether any rank had a gradient for segment i. `buffer` (optional) is used as the flat
    buffer when its size and dtype fit.
    """
    n = sum(numels)
    flat = fill_flat(inputs, numels, dtype, device, len(numels), buffer, prescale)
    flat[n:] = torch.tensor([0.0 if g is None else 1.0 for g in inputs], dtype=dtype)
    flat = yield flat
    if postscale != 1.0:
        flat[:n].mul_(postscale)
    return flat[:n], (flat[n:] > 0).tolist()


def sparse_allgather(grad: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
                     rank: int, world_size: int, prescale: float, postscale: float) -> StageGen:
    """Allgather a sparse COO gradient through SUM allreduces; return the coalesced sum (or None).

    Every rank writes its rows into its own slot of a zeroed buffer, so the sum is the
    concatenation (adding zeros is exact): counts, then indices, then values, three stages whose
    sizes every rank knows after the first. None (no gradient on this rank) contributes no rows;
    the result is None when no rank had any.
    """
    if grad is not None:
        grad = grad.coalesce()
        idx, val = grad.indices(), grad.values()
        device = val.device
    else:
        idx = torch.zeros((1, 0), dtype=torch.int64)
        val = torch.zeros((0,) + tuple(shape[1:]), dtype=dtype)
        device = torch.device("cpu")
    if idx.shape[0] != 1:
        raise ValueError(f"sparse_allgather: a sparse gradient of shape {tuple(shape)} with "
                         f"{idx.shape[0]} sparse dimensions; only row-sparse gradients "
                         "(nn.Embedding(sparse=True)) are supported: pass sparse_as_dense=True")
    nnz = idx.shape[1]
    counts = torch.zeros(world_size + 1, dtype=torch.int64, device=device)
    counts[rank] = nnz
    counts[world_size] = 0 if grad is None else 1  # how many ranks had a gradient at all
    counts = yield counts
    total = int(counts[:world_size].sum())
    off = int(counts[:rank].sum())
    had = int(counts[world_size])
    rows = torch.zeros(total, dtype=torch.int64, device=device)
    rows[off:off + nnz] = idx[0]
    rows = yield rows
    vals = torch.zeros((total,) + tuple(shape[1:]), dtype=dtype, device=device)
    vals[off:off + nnz] = val * prescale if prescale != 1.0 else val
    vals = yield vals
    if had == 0:
        return None
    if postscale != 1.0:
        vals.mul_(postscale)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), vals, tuple(shape)).coalesce()
