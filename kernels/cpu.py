"""numba CPU kernels of CSC: each fuses what the torch reference does in several passes.

- ``chunk_norms``: residual-add (and DGC momentum) written back into the gradient, or into a
  buffer of its own with the gradient zeroed in the same loop, and each chunk's norm, in one
  read of the gradient (the norm loop reruns over the chunk just written, still in L1 cache).
- ``select_chunks``: top-k by a partition, O(n), no sort.
- ``pack_chunks``: gather + scale + round to the wire type, straight into the send buffer.
- ``unpack_update``: scatter back + residual update + zeroing of the unsent chunks, one pass.
- ``unpack_sent``: the same for the k sent chunks only, when v already sits in the residual and
  the gradient is zero (``chunk_norms(..., v_out=, zero_grad=True)``): CSC with error feedback
  then makes one full pass over the bucket per step instead of two.
- ``all_finite``: counts inf/NaN exponents in the raw bits (no mask tensor).
- ``masked_chunk_norms`` / ``dense_scatter``: the few chunks that hold dense parameters, and the
  dense parameters' results and rounding errors, each in one call instead of 5-6 torch ops.
- ``cast_feedback`` / ``upcast_finite``: the dense FP16 wire with error feedback in one pass
  before the allreduce (add, round, rounding error) and one after (upcast + finiteness count).

The kernels live in ``cpu_chunked.py`` (the chunked path) and ``cpu_wire.py`` (the dense wire
and the wire codes); this module is their torch-facing side. All kernels are
``@njit(parallel=True, nogil=True, cache=True)`` over chunks (or blocks) and take
torch CPU tensors zero-copy through ``Tensor.numpy()``; half and bfloat16 buffers are seen as
uint16 (numba has no float16 on CPU, see ``half.py``). Every launch goes through
``_threads.launch()`` (thread count, and a lock when the layer is workqueue). Arguments are
validated by the dispatch module (``gradientflow.kernels``); this module trusts them, except for
chunk indices, which are range-checked here because a bad one would write out of bounds.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _threads, reference
from .reference import nchunks_of

__all__ = [
    "chunk_norms",
    "pack_chunks",
    "unpack_update",
    "unpack_sent",
    "masked_chunk_norms",
    "dense_scatter",
    "select_chunks",
    "all_finite",
    "cast_scaled",
    "upcast_scaled",
    "cast_feedback",
    "upcast_finite",
    "warm_up",
]

_threads.configure()  # before the first parallel kernel starts numba's pool
_threads.start_on_main_thread()  # a TBB pool must be started by the main thread

from .cpu_chunked import (_dense_scatter_kernel, _masked_norms_kernel,  # noqa: E402
                          _norms_kernel, _pack_f32_kernel, _pack_u16_kernel, _select_kernel,
                          _unpack_kernel, _unpack_sent_kernel)
from .cpu_wire import (_BLOCK, _CODE, _cast_f32_kernel, _cast_feedback_f32_kernel,  # noqa: E402
                       _cast_feedback_u16_kernel, _cast_u16_kernel, _count_masked_kernel,
                       _upcast_finite_kernel, _upcast_kernel)

_EMPTY = np.zeros(0, dtype=np.float32)


# ---- torch-facing wrappers -------------------------------------------------------------------


def _f32(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a float32 CPU tensor."""
    return t.detach().numpy()


def _wire(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a wire buffer: float32 as is, 16-bit types as uint16 bits."""
    if t.dtype == torch.float32:
        return t.detach().numpy()
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def _indices(op: str, indices: torch.Tensor, nch: int) -> np.ndarray:
    """Return the chunk indices as int64 numpy, refusing any outside [0, nchunks)."""
    idx = indices.detach().numpy()
    if idx.size and (idx.min() < 0 or idx.max() >= nch):
        raise ValueError(
            f"{op}: chunk indices must lie in [0, {nch}), got min {idx.min()} max {idx.max()}; "
            "pass the indices select_chunks returned for this buffer"
        )
    return idx


def chunk_norms(grad, residual, chunk_size, norm="l1", *, momentum=None, momentum_out=None,
                m=0.9, nesterov=False, v_out=None, zero_grad=False):
    """numba version of ``reference.chunk_norms`` (see the dispatch module for the contract)."""
    nch = nchunks_of(grad.numel(), chunk_size)
    norms = torch.empty(nch, dtype=torch.float32)
    if nch == 0:
        return norms
    mode = 0 if momentum is None else (2 if nesterov else 1)
    g = _f32(grad)
    with _threads.launch():
        _norms_kernel(
            g,
            _EMPTY if residual is None else _f32(residual),
            residual is not None,
            _EMPTY if momentum is None else _f32(momentum),
            _EMPTY if momentum_out is None else _f32(momentum_out),
            mode, m, chunk_size, norm == "l2", norms.numpy(),
            g if v_out is None else _f32(v_out), v_out is not None, bool(zero_grad),
        )
    return norms


def select_chunks(norms, k, *, forced=None):
    """numba version of ``reference.select_chunks``; forced chunks take the reference's sort."""
    if forced is not None:
        return reference.select_chunks(norms, k, forced=forced)
    key = norms.detach()
    if key.dtype != torch.float32:
        key = key.to(torch.float32)
    out = torch.empty(k, dtype=torch.int64)
    _select_kernel(key.numpy(), k, out.numpy())
    return out


_FINITE_MASK = {torch.float32: (torch.int32, np.uint32, 0x7F800000),
                torch.float16: (torch.int16, np.uint16, 0x7C00),
                torch.bfloat16: (torch.int16, np.uint16, 0x7F80)}


def all_finite(x):
    """numba version of ``reference.all_finite`` (float32, float16, bfloat16)."""
    ity, npty, mask = _FINITE_MASK[x.dtype]
    bits = x.detach().view(ity).numpy().view(npty)
    return bool(_count_masked_kernel(bits, npty(mask)) == 0)


def pack_chunks(v, indices, chunk_size, scale, wire_dtype, *, out):
    """numba version of ``reference.pack_chunks``."""
    idx = _indices("pack_chunks", indices, nchunks_of(v.numel(), chunk_size))
    if idx.size == 0:
        return out
    with _threads.launch():
        if wire_dtype == torch.float32:
            _pack_f32_kernel(_f32(v), idx, chunk_size, scale, _wire(out))
        else:
            _pack_u16_kernel(_f32(v), idx, chunk_size, scale, _CODE[wire_dtype], _wire(out))
    return out


def _wire_pair(packed_reduced, packed_local):
    """The unpack kernels' wire arguments: reduced bits and code, local bits and code, has-local.

    Without a local copy the reduced buffer stands in (never read: has-local is False).
    """
    red = _wire(packed_reduced)
    if packed_local is None:
        return red, _CODE[packed_reduced.dtype], red, _CODE[packed_reduced.dtype], False
    return red, _CODE[packed_reduced.dtype], _wire(packed_local), _CODE[packed_local.dtype], True


def unpack_update(v, residual, packed_reduced, packed_local, indices, chunk_size, unscale,
                  err_scale, *, out):
    """numba version of ``reference.unpack_update``."""
    nch = nchunks_of(v.numel(), chunk_size)
    idx = _indices("unpack_update", indices, nch)
    cmap = np.full(nch, -1, dtype=np.int64)
    cmap[idx] = np.arange(idx.size, dtype=np.int64)
    if nch == 0:
        return out
    with _threads.launch():
        _unpack_kernel(
            _f32(v),
            _EMPTY if residual is None else _f32(residual),
            residual is not None,
            *_wire_pair(packed_reduced, packed_local),
            cmap, chunk_size, unscale, err_scale, _f32(out),
        )
    return out


def unpack_sent(out, residual, packed_reduced, packed_local, indices, chunk_size, unscale,
                err_scale):
    """numba version of ``reference.unpack_sent``."""
    nch = nchunks_of(out.numel(), chunk_size)
    idx = _indices("unpack_sent", indices, nch)
    if idx.size > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ValueError(
            "unpack_sent: chunk indices must be strictly increasing (as select_chunks returns "
            "them); "
            "a repeated chunk would take its rounding error off the residual twice"
        )
    if idx.size == 0:
        return out
    with _threads.launch():
        _unpack_sent_kernel(
            _f32(out), _EMPTY if residual is None else _f32(residual), residual is not None,
            *_wire_pair(packed_reduced, packed_local),
            idx, chunk_size, unscale, err_scale,
        )
    return out


def masked_chunk_norms(v, chunks, keep, chunk_size, norm, *, out):
    """numba version of ``reference.masked_chunk_norms``."""
    ch = _indices("masked_chunk_norms", chunks, nchunks_of(v.numel(), chunk_size))
    if ch.size == 0:
        return out
    _masked_norms_kernel(_f32(v), ch, keep.detach().numpy(), chunk_size, norm == "l2", out.numpy())
    return out


def dense_scatter(out, residual, idx, reduced, local, v, unscale, err_scale):
    """numba version of ``reference.dense_scatter``."""
    i = idx.detach().numpy()
    if i.size == 0:
        return out
    n = out.numel()
    if i.min() < 0 or i.max() >= n:
        raise ValueError(
            f"dense_scatter: positions must lie in [0, {n}), got min {i.min()} max {i.max()}"
        )
    red = _wire(reduced)
    loc = red if local is None else _wire(local)
    loc_code = _CODE[(local if local is not None else reduced).dtype]
    _dense_scatter_kernel(_f32(out), _EMPTY if residual is None else _f32(residual),
                          residual is not None, i, red, _CODE[reduced.dtype], loc, loc_code,
                          _f32(v), unscale, err_scale)
    return out


def cast_scaled(x, scale, wire_dtype, *, out):
    """numba version of ``reference.cast_scaled``."""
    if x.numel() == 0:
        return out
    with _threads.launch():
        if wire_dtype == torch.float32:
            _cast_f32_kernel(_f32(x), scale, _wire(out))
        else:
            _cast_u16_kernel(_f32(x), scale, _CODE[wire_dtype], _wire(out))
    return out


def upcast_scaled(x, scale, *, out):
    """numba version of ``reference.upcast_scaled``."""
    if x.numel() == 0:
        return out
    with _threads.launch():
        _upcast_kernel(_wire(x), _CODE[x.dtype], scale, _f32(out))
    return out


def cast_feedback(x, residual, scale, wire_dtype, err_scale, *, out, residual_out):
    """numba version of ``reference.cast_feedback``."""
    if x.numel() == 0:
        return out
    r = _EMPTY if residual is None else _f32(residual)
    r_out = _EMPTY if residual_out is None else _f32(residual_out)
    with _threads.launch():
        if wire_dtype == torch.float32:
            _cast_feedback_f32_kernel(_f32(x), r, residual is not None, scale, err_scale,
                                      _wire(out), r_out, residual_out is not None)
        else:
            _cast_feedback_u16_kernel(_f32(x), r, residual is not None, scale, _CODE[wire_dtype],
                                      err_scale, _wire(out), r_out, residual_out is not None)
    return out


def upcast_finite(x, scale, *, out):
    """numba version of ``reference.upcast_finite``."""
    bad = np.zeros(-(-x.numel() // _BLOCK), dtype=np.int64)
    if x.numel() == 0:
        return True
    with _threads.launch():
        _upcast_finite_kernel(_wire(x), _CODE[x.dtype], scale, _f32(out), bad)
    return not bad.any()


def warm_up() -> None:
    """Compile (or load from cache) every kernel signature the dispatch can use, on tiny inputs."""
    g = torch.ones(5)
    r = torch.ones(5)
    mom = torch.ones(5)
    for res in (None, r):
        for mo in (None, mom):
            for l2 in ("l1", "l2"):
                chunk_norms(g, res, 2, l2, momentum=mo, momentum_out=mo, nesterov=mo is not None)
                chunk_norms(g, res, 2, l2, momentum=mo, momentum_out=mo, nesterov=mo is not None,
                            v_out=torch.empty(5), zero_grad=True)
    idx = torch.tensor([0, 2])
    select_chunks(torch.ones(5), 2)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        all_finite(torch.ones(3, dtype=dt))
    for wd in (torch.float32, torch.float16, torch.bfloat16):
        p = torch.empty(4, dtype=wd)
        pack_chunks(g, idx, 2, 1.0, wd, out=p)
        unpack_update(g, r, p, p, idx, 2, 1.0, 1.0, out=torch.empty(5))
        unpack_update(g, None, p, None, idx, 2, 1.0, 1.0, out=g)
        unpack_sent(g, r, p, p, idx, 2, 1.0, 1.0)
        unpack_sent(g, None, p, None, idx, 2, 1.0, 1.0)
        dense_scatter(g, r, idx, p[:2], p[:2], g[:2], 1.0, 1.0)
        dense_scatter(g, None, idx, p[:2], None, g[:2], 1.0, 1.0)
    for l2 in ("l1", "l2"):
        masked_chunk_norms(g, idx, torch.ones(2, 2, dtype=torch.bool), 2, l2, out=torch.empty(3))
    for wd in (torch.float32, torch.float16, torch.bfloat16):
        c = torch.empty(5, dtype=wd)
        cast_scaled(g, 1.0, wd, out=c)
        upcast_scaled(c, 1.0, out=torch.empty(5))
        upcast_finite(c, 1.0, out=torch.empty(5))
        for res in (None, r):
            for res_out in (None, torch.empty(5)):
                cast_feedback(g, res, 1.0, wd, 1.0, out=c, residual_out=res_out)
