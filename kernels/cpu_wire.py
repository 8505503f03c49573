"""numba CPU kernels of the dense wire, and the wire codes every CPU kernel reads packed buffers by.

- ``_cast_*`` / ``_upcast_kernel``: scale and round to the wire type, and back.
- ``_cast_feedback_*`` / ``_upcast_finite_kernel``: the dense FP16 wire with error feedback in one
  pass before the allreduce (add, round, rounding error) and one after (upcast + finiteness count).
- ``_count_masked_kernel``: inf/NaN exponents counted in the raw bits (``all_finite``).

Launched only through the wrappers of ``cpu.py`` (thread count, pool lock); numba's cache keys
each kernel on this file.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .half import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_bits, f32_to_f16_bits

_PAR = dict(parallel=True, nogil=True, cache=True)

# Wire codes: how a packed buffer's elements are read/written.
_F32, _F16, _BF16 = 0, 1, 2
_CODE = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}
# Dense kernels run over blocks of this many elements (one prange iteration each).
_BLOCK = 16384


@njit(inline="always", cache=True, nogil=True)
def _load(a, i, code):
    """Read element i of a packed buffer as float32 (code: 0 float32, 1 binary16, 2 bfloat16)."""
    if code == 0:
        return np.float32(a[i])
    if code == 1:
        return f16_bits_to_f32(a[i])
    return bf16_bits_to_f32(a[i])


@njit(nogil=True, cache=True)
def _count_masked_kernel(bits, mask):
    """How many elements have every bit of ``mask`` set (mask = the exponent: inf or NaN)."""
    cnt = 0
    for i in range(bits.size):
        cnt += (bits[i] & mask) == mask
    return cnt


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
