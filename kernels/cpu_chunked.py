"""numba CPU kernels of CSC's chunked path: chunk norms (with residual and DGC momentum),
top-k selection, pack to the wire, and the unpack / scatter back with the residual update.

Launched only through the wrappers of ``cpu.py`` (thread count, pool lock, index checks);
numba's cache keys each kernel on this file.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_wire import _load
from .half import f32_to_bf16_bits, f32_to_f16_bits

_PAR = dict(parallel=True, nogil=True, cache=True)


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
