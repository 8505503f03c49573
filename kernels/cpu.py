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

All kernels are ``@njit(parallel=True, nogil=True, cache=True)`` over chunks (or blocks) and take
torch CPU tensors zero-copy through ``Tensor.numpy()``; half and bfloat16 buffers are seen as
uint16 (numba has no float16 on CPU, see ``half.py``). Every launch goes through
``_threads.launch()`` (thread count, and a lock when the layer is workqueue). Arguments are
validated by the dispatch module (``gradientflow.kernels``); this module trusts them, except for
chunk indices, which are range-checked here because a bad one would write out of bounds.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from . import _threads, reference
from .half import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_bits, f32_to_f16_bits
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

_PAR = dict(parallel=True, nogil=True, cache=True)

# Wire codes: how a packed buffer's elements are read/written.
_F32, _F16, _BF16 = 0, 1, 2
_CODE = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}
_EMPTY = np.zeros(0, dtype=np.float32)


# ---- kernels ---------------------------------------------------------------------------------


# Inner loops run over per-chunk slices from index 0: numba then needs no negative-index
# wraparound check and LLVM vectorises them (indexing with a computed signed offset did not:
# docs/DECISIONS.md, "CPU kernels").


@njit(inline="never", cache=True, nogil=True, fastmath={"reassoc"})
def _chunk_sum(g, l2):
    """Sum |g| or g*g; reassociation lets LLVM vectorise the reduction."""
    acc = np.float32(0.0)
    if l2:
        for i in range(g.size):
            acc += g[i] * g[i]
    else:
        for i in range(g.size):
            acc += abs(g[i])
    return acc


@njit(inline="never", cache=True, nogil=True, fastmath={"reassoc"})
def _add_zero_sum(g, r, v, l2):
    """v = g + r, g = 0 and the sum of |v| (or v*v), in one loop over one chunk.

    The error-feedback case of CSC in a single vectorised loop, faster than writing v, zeroing
    g and summing v in separate loops over the (L1-resident) chunk (docs/DECISIONS.md, "CPU
    kernels"). Only the reduction is reassociated, as in ``_chunk_sum``; v itself is the exact
    float32 sum.
    """
    acc = np.float32(0.0)
    if l2:
        for i in range(g.size):
            x = g[i] + r[i]
            v[i] = x
            g[i] = np.float32(0.0)
            acc += x * x
    else:
        for i in range(g.size):
            x = g[i] + r[i]
            v[i] = x
            g[i] = np.float32(0.0)
            acc += abs(x)
    return acc


@njit(inline="never", cache=True, nogil=True)
def _momentum_combine(g, r, has_r, mm, mo, nesterov, mf, v, zero_g):
    """One chunk's u and v under momentum correction, g zeroed in the same loop if asked.

    Plain: u = m*mm + g, v = r + u; Nesterov: u = (mm + g)*m, v = r + u + g (r left out without
    a residual). No fast-math here: u and v must be bit-identical to the reference, so the norm
    is summed by ``_chunk_sum`` after this loop, over the chunk still in L1. One loop instead of
    one for u and v and another to zero g: one read of the chunk fewer (docs/DECISIONS.md, "CPU
    kernels"). The flags are loop invariants that LLVM unswitches, so the loop still vectorises.
    """
    for i in range(g.size):
        x = g[i]
        if nesterov:
            u = (mm[i] + x) * mf
            y = u + x
            if has_r:
                y = (r[i] + u) + x
        else:
            u = mf * mm[i] + x
            y = u
            if has_r:
                y = r[i] + u
        mo[i] = u
        v[i] = y
        if zero_g:
            g[i] = np.float32(0.0)


@njit(**_PAR)
def _norms_kernel(g, r, has_r, mom, mom_out, mode, m, chunk, l2, norms, vout, sep, zero_g):
    """v = grad (+ momentum) + residual into vout, u into mom_out, and each chunk's norm.

    mode 0: no momentum; 1: u = m*mom + g, v = r + u; 2 (Nesterov): u = (mom + g)*m,
    v = r + u + g. The additions are in the reference's order, so v is bit-identical.
    ``vout`` is g itself unless ``sep``; ``zero_g`` (only with ``sep``) then zeroes g's chunk in
    the same loop, so the caller needs no second full pass over g to clear what is not sent.
    """
    n = g.size
    mf = np.float32(m)
    for c in prange(norms.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        gg = g[lo:hi]
        vo = vout[lo:hi]
        if mode == 0 and has_r and sep and zero_g:
            norms[c] = _add_zero_sum(gg, r[lo:hi], vo, l2)
            continue
        if mode != 0:
            _momentum_combine(gg, r[lo:hi], has_r, mom[lo:hi], mom_out[lo:hi], mode == 2, mf, vo,
                              zero_g)
        elif has_r:
            rr = r[lo:hi]
            for i in range(gg.size):
                vo[i] = gg[i] + rr[i]
        elif sep:
            for i in range(gg.size):
                vo[i] = gg[i]
        if zero_g and mode == 0:
            for i in range(gg.size):
                gg[i] = np.float32(0.0)
        norms[c] = _chunk_sum(vo, l2)


@njit(**_PAR)
def _pack_f32_kernel(v, idx, chunk, scale, out):
    """out[j*C + t] = v[idx[j]*C + t] * scale (0 past the end of v)."""
    n = v.size
    s = np.float32(scale)
    for j in prange(idx.size):
        base = idx[j] * chunk
        src = v[base:min(base + chunk, n)]
        dst = out[j * chunk:(j + 1) * chunk]
        for t in range(src.size):
            dst[t] = src[t] * s
        for t in range(src.size, chunk):
            dst[t] = np.float32(0.0)


@njit(**_PAR)
def _pack_u16_kernel(v, idx, chunk, scale, code, out):
    """As _pack_f32_kernel, rounding to binary16 (code 1) or bfloat16 (code 2) bits."""
    n = v.size
    s = np.float32(scale)
    for j in prange(idx.size):
        base = idx[j] * chunk
        src = v[base:min(base + chunk, n)]
        dst = out[j * chunk:(j + 1) * chunk]
        if code == 1:
            for t in range(src.size):
                dst[t] = np.uint16(f32_to_f16_bits(src[t] * s))
        else:
            for t in range(src.size):
                dst[t] = np.uint16(f32_to_bf16_bits(src[t] * s))
        for t in range(src.size, chunk):
            dst[t] = np.uint16(0)


@njit(inline="always", cache=True, nogil=True)
def _load(a, i, code):
    """Read element i of a packed buffer as float32 (code: 0 float32, 1 binary16, 2 bfloat16)."""
    if code == 0:
        return np.float32(a[i])
    if code == 1:
        return f16_bits_to_f32(a[i])
    return bf16_bits_to_f32(a[i])


@njit(**_PAR)
def _unpack_kernel(v, r, has_r, red, red_code, loc, loc_code, has_loc, cmap, chunk,
                   unscale, err_scale, out):
    """One pass over v: scatter the reduced chunks into out, the rest into the residual.

    ``cmap[c]`` is the position j of chunk c in the packed buffers, or -1 if it was not sent.
    Each element of v is read before out (which may be v) is written.
    """
    n = v.size
    us = np.float32(unscale)
    es = np.float32(err_scale)
    for c in prange(cmap.size):
        lo = c * chunk
        hi = min(lo + chunk, n)
        vv = v[lo:hi]
        oo = out[lo:hi]
        j = cmap[c]
        if j < 0:
            if has_r:
                rr = r[lo:hi]
                for i in range(vv.size):
                    rr[i] = vv[i]
            for i in range(oo.size):
                oo[i] = np.float32(0.0)
        else:
            pr = red[j * chunk:j * chunk + vv.size]
            if has_r:
                rr = r[lo:hi]
                if has_loc:
                    pl = loc[j * chunk:j * chunk + vv.size]
                    for i in range(vv.size):
                        x = vv[i]
                        y = _load(pr, i, red_code) * us
                        rr[i] = x - _load(pl, i, loc_code) * es
                        oo[i] = y
                else:
                    for i in range(rr.size):
                        rr[i] = np.float32(0.0)
            if not (has_r and has_loc):
                for i in range(oo.size):
                    oo[i] = _load(pr, i, red_code) * us


@njit(**_PAR)
def _unpack_sent_kernel(out, r, has_r, red, red_code, loc, loc_code, has_loc, idx, chunk,
                        unscale, err_scale):
    """Sent chunks only: out = reduced * unscale; r = r - local * err_scale (0 without local)."""
    n = out.size
    us = np.float32(unscale)
    es = np.float32(err_scale)
    for j in prange(idx.size):
        lo = idx[j] * chunk
        hi = min(lo + chunk, n)
        oo = out[lo:hi]
        pr = red[j * chunk:j * chunk + oo.size]
        for i in range(oo.size):
            oo[i] = _load(pr, i, red_code) * us
        if has_r:
            rr = r[lo:hi]
            if has_loc:
                pl = loc[j * chunk:j * chunk + oo.size]
                for i in range(rr.size):
                    rr[i] = rr[i] - _load(pl, i, loc_code) * es
            else:
                for i in range(rr.size):
                    rr[i] = np.float32(0.0)


@njit(nogil=True, cache=True)
def _masked_norms_kernel(v, chunks, keep, chunk, l2, norms):
    """norms[chunks[m]] = _chunk_sum of chunk chunks[m] with the elements not in keep[m] zeroed.

    Serial: a bucket has a few dozen such chunks, and a parallel launch costs more than the
    work (docs/DECISIONS.md, "CPU kernels").
    """
    n = v.size
    buf = np.zeros(chunk, dtype=np.float32)
    for m in range(chunks.size):
        lo = chunks[m] * chunk
        hi = min(lo + chunk, n)
        vv = v[lo:hi]
        kk = keep[m]
        bb = buf[: vv.size]
        for i in range(vv.size):
            bb[i] = vv[i] if kk[i] else np.float32(0.0)
        norms[chunks[m]] = _chunk_sum(bb, l2)


@njit(nogil=True, cache=True)
def _dense_scatter_kernel(out, r, has_r, idx, red, red_code, loc, loc_code, v, unscale, err_scale):
    """out[idx[i]] = red[i] * unscale; r[idx[i]] = v[i] - loc[i] * err_scale (if has_r)."""
    us = np.float32(unscale)
    es = np.float32(err_scale)
    for i in range(idx.size):
        out[idx[i]] = _load(red, i, red_code) * us
    if has_r:
        for i in range(idx.size):
            r[idx[i]] = v[i] - _load(loc, i, loc_code) * es


@njit(nogil=True, cache=True)
def _count_masked_kernel(bits, mask):
    """How many elements have every bit of ``mask`` set (mask = the exponent: inf or NaN)."""
    cnt = 0
    for i in range(bits.size):
        cnt += (bits[i] & mask) == mask
    return cnt


@njit(nogil=True, cache=True)
def _select_kernel(norms, k, out):
    """out = the k largest of norms (NaN as +inf), ties to the lower index, in index order.

    The k-th largest key is found by a partition (O(n)); every key above it is taken, and as
    many keys equal to it as are still needed, in index order: what a stable descending sort
    followed by an ascending sort of the first k gives, without sorting.
    """
    n = norms.size
    key = np.empty(n, dtype=np.float32)
    for i in range(n):
        x = norms[i]
        key[i] = np.inf if np.isnan(x) else x
    if k == 0:
        return
    if k == n:
        for i in range(n):
            out[i] = i
        return
    t = np.partition(key, n - k)[n - k]
    above = 0
    for i in range(n):
        above += key[i] > t
    ties = k - above
    j = 0
    for i in range(n):
        x = key[i]
        if x > t:
            out[j] = i
            j += 1
        elif x == t and ties > 0:
            out[j] = i
            j += 1
            ties -= 1


@njit(**_PAR)
def _cast_f32_kernel(x, scale, out):
    """out = x * scale (float32)."""
    s = np.float32(scale)
    for i in prange(x.size):
        out[i] = x[i] * s


@njit(**_PAR)
def _cast_u16_kernel(x, scale, code, out):
    """out = bits of round(x * scale) in binary16 (code 1) or bfloat16 (code 2)."""
    s = np.float32(scale)
    if code == 1:
        for i in prange(x.size):
            out[i] = np.uint16(f32_to_f16_bits(x[i] * s))
    else:
        for i in prange(x.size):
            out[i] = np.uint16(f32_to_bf16_bits(x[i] * s))


@njit(**_PAR)
def _upcast_kernel(x, code, scale, out):
    """out = float32(x) * scale, x float32 or 16-bit wire bits."""
    s = np.float32(scale)
    for i in prange(x.size):
        out[i] = _load(x, i, code) * s


# Elements per block of the dense FP16 kernels: a block's slices start at index 0 (vectorised
# inner loops, see above) and 16 K elements keep a block's three streams within L1/L2.
_BLOCK = 16384


@njit(inline="always", cache=True, nogil=True)
def _round_wire(y, code):
    """Return (bits or value to store, its float32 value) of y rounded to the wire code."""
    if code == 1:
        h = f32_to_f16_bits(y)
        return h, f16_bits_to_f32(h)
    h = f32_to_bf16_bits(y)
    return h, bf16_bits_to_f32(h)


@njit(**_PAR)
def _cast_feedback_u16_kernel(x, r, has_r, scale, code, err_scale, out, r_out, has_r_out):
    """v = x + r; out = bits of round(v * scale); r_out = v - float32(out) * err_scale, one pass.

    The common case (residual in and out) and each wire code get their own inner loop: with
    the flags and the code tested inside one loop, LLVM did not vectorise it.
    """
    n = x.size
    s = np.float32(scale)
    es = np.float32(err_scale)
    for b in prange((n + _BLOCK - 1) // _BLOCK):
        lo = b * _BLOCK
        hi = min(lo + _BLOCK, n)
        xx = x[lo:hi]
        oo = out[lo:hi]
        if has_r and has_r_out:
            rr = r[lo:hi]
            ro = r_out[lo:hi]
            if code == 1:
                for i in range(xx.size):
                    v = xx[i] + rr[i]
                    h = f32_to_f16_bits(v * s)
                    oo[i] = np.uint16(h)
                    ro[i] = v - f16_bits_to_f32(h) * es
            else:
                for i in range(xx.size):
                    v = xx[i] + rr[i]
                    h = f32_to_bf16_bits(v * s)
                    oo[i] = np.uint16(h)
                    ro[i] = v - bf16_bits_to_f32(h) * es
        else:
            for i in range(xx.size):
                v = xx[i] + r[lo + i] if has_r else xx[i]
                h, w = _round_wire(v * s, code)
                oo[i] = np.uint16(h)
                if has_r_out:
                    r_out[lo + i] = v - w * es


@njit(**_PAR)
def _cast_feedback_f32_kernel(x, r, has_r, scale, err_scale, out, r_out, has_r_out):
    """As _cast_feedback_u16_kernel for an FP32 wire (the error is only the 1/n pre-scale's)."""
    n = x.size
    s = np.float32(scale)
    es = np.float32(err_scale)
    for b in prange((n + _BLOCK - 1) // _BLOCK):
        lo = b * _BLOCK
        hi = min(lo + _BLOCK, n)
        xx = x[lo:hi]
        oo = out[lo:hi]
        for i in range(xx.size):
            v = xx[i] + r[lo + i] if has_r else xx[i]
            w = v * s
            oo[i] = w
            if has_r_out:
                r_out[lo + i] = v - w * es


@njit(**_PAR)
def _upcast_finite_kernel(x, code, scale, out, bad):
    """out = float32(x) * scale; bad[b] = how many elements of block b of out are inf or NaN."""
    n = x.size
    s = np.float32(scale)
    for b in prange(bad.size):
        lo = b * _BLOCK
        hi = min(lo + _BLOCK, n)
        xx = x[lo:hi]
        oo = out[lo:hi]
        cnt = 0
        for i in range(xx.size):
            y = _load(xx, i, code) * s
            oo[i] = y
            # An all-ones exponent is inf or NaN; an integer count vectorises (a float test
            # such as summing y - y would make the loop a serial chain of dependent adds).
            cnt += ((f32_to_bits(y) >> 23) & 0xFF) == 0xFF
        bad[b] = cnt


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
