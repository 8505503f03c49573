"""numba CUDA kernels of CSC, zero-copy on torch CUDA tensors, launched on torch's current stream.

Imported lazily by the dispatch module (importing numba.cuda costs time and needs a driver).
Two layers:

- ``launch_*`` functions take numba device arrays (or, under ``NUMBA_ENABLE_CUDASIM=1``, plain
  numpy arrays: the simulator does not take torch tensors) and a stream; the tests drive these
  under the simulator;
- the torch-facing functions with the dispatch signatures wrap tensors with
  ``cuda.as_cuda_array(t, sync=False)`` (no copy; no extra sync because the kernels run on the
  same stream torch uses) and launch on ``torch.cuda.current_stream()``.

16-bit wire buffers are handled as uint16 bits with the same integer rounding as the CPU
kernels (``half.py``), so CPU and GPU produce identical bits. Note numba 0.68's built-in CUDA
target knows CUDA toolkits up to 12.x; a CUDA 13 machine needs the ``numba-cuda`` package.

A scale factor given as a one-element device tensor (an agreed wire scale) is read back by the
host here, which waits for whatever computed it; the Triton kernels read it on the device.

Chunk norms reduce each chunk in one block with a fixed tree order: deterministic run to run
(but not bit-identical to torch's sum, like the CPU kernel).

Bit-for-bit agreement with torch needs every multiply that feeds an add rounded on its own:
NVVM contracts ``a * b + c`` into one fused multiply-add by default (one rounding instead of
two), where torch runs the multiply and the add as separate kernels. ``_mul`` is libdevice's
``fmul_rn``, which is never contracted (on an H100, 245,765 of 1 M results of ``a * b + c``
differed from torch's with the default and none with ``fmul_rn``; gpu-check of 2026-11-22 in
benchmarks/results/HISTORY.md).
"""

from __future__ import annotations

import math

import numpy as np

# numba-cuda 0.30 registers an overload for np.row_stack when it builds its typing context (at
# the first kernel compile); numpy 2.5 removed that alias of vstack, and every compile then
# fails with "module 'numpy' has no attribute 'row_stack'" (seen on an H100 with numpy 2.5.2,
# numba-cuda 0.30.4). Restoring the alias is harmless: it is what numpy < 2.5 had.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda

from . import half as _half
from .reference import nchunks_of

__all__ = [
    "check_available",
    "chunk_norms",
    "pack_chunks",
    "unpack_update",
    "cast_scaled",
    "upcast_scaled",
    "launch_chunk_norms",
    "launch_pack",
    "launch_unpack",
    "launch_cast",
    "launch_upcast",
]

SIMULATOR = bool(config.ENABLE_CUDASIM)
# Threads per block; the simulator runs each thread as a Python thread, so keep it small there.
TPB = 32 if SIMULATOR else 256
_F32, _F16, _BF16 = 0, 1, 2

_dev = cuda.jit(device=True)
_f32bits_to_f16bits = _dev(_half.f32bits_to_f16bits)
_f32bits_to_bf16bits = _dev(_half.f32bits_to_bf16bits)
_f16bits_to_f32bits = _dev(_half.f16bits_to_f32bits)
_bf16bits_to_f32bits = _dev(_half.bf16bits_to_f32bits)

if SIMULATOR:
    # The simulator's libdevice is stubs: reinterpret through numpy instead.
    @cuda.jit(device=True)
    def _f32_bits(x):
        return np.int64(np.float32(x).view(np.uint32))

    @cuda.jit(device=True)
    def _bits_f32(b):
        return np.uint32(b & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def _mul(a, b):
        return a * b

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(x):
        return np.int64(libdevice.float_as_int(np.float32(x))) & 0xFFFFFFFF

    @cuda.jit(device=True)
    def _bits_f32(b):
        return libdevice.int_as_float(np.int32(b))

    @cuda.jit(device=True)
    def _mul(a, b):
        """float32 a * b rounded on its own: never fused into a following add (see above)."""
        return libdevice.fmul_rn(np.float32(a), np.float32(b))


@cuda.jit(device=True)
def _load(a, i, code):
    """Read element i of a wire buffer as float32 (code 0 float32, 1 binary16, 2 bfloat16)."""
    if code == 0:
        return np.float32(a[i])
    if code == 1:
        return _bits_f32(_f16bits_to_f32bits(np.int64(a[i])))
    return _bits_f32(_bf16bits_to_f32bits(np.int64(a[i])))


@cuda.jit(device=True)
def _round16(x, code):
    """Round float32 x to binary16 (code 1) or bfloat16 (code 2) bits."""
    b = _f32_bits(x)
    if code == 1:
        return np.uint16(_f32bits_to_f16bits(b))
    return np.uint16(_f32bits_to_bf16bits(b))


# ---- kernels ---------------------------------------------------------------------------------


@cuda.jit
def _norms_kernel(g, r, has_r, mom, mom_out, mode, m, chunk, l2, norms, vout, zero_g):
    """One block per chunk (grid-strided): fold residual/momentum into vout (g itself, or a
    buffer of its own, then g may be zeroed), reduce the norm."""
    n = g.size
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(TPB, np.float32)
    mf = np.float32(m)
    c = cuda.blockIdx.x
    while c < norms.size:
        lo = c * chunk
        hi = min(lo + chunk, n)
        acc = np.float32(0.0)
        i = lo + tid
        while i < hi:
            x = g[i]
            if mode == 0:
                v = x + r[i] if has_r else x
            elif mode == 1:
                u = _mul(mf, mom[i]) + x
                mom_out[i] = u
                v = r[i] + u if has_r else u
            else:
                u = _mul(mom[i] + x, mf)
                mom_out[i] = u
                v = (r[i] + u) + x if has_r else u + x
            vout[i] = v
            if zero_g:
                g[i] = np.float32(0.0)
            acc += v * v if l2 else abs(v)
            i += TPB
        buf[tid] = acc
        cuda.syncthreads()
        s = TPB // 2
        while s > 0:
            if tid < s:
                buf[tid] += buf[tid + s]
            cuda.syncthreads()
            s //= 2
        if tid == 0:
            norms[c] = buf[0]
        cuda.syncthreads()
        c += cuda.gridDim.x


@cuda.jit
def _pack_kernel(v, idx, chunk, scale, code, out):
    """out[j*C + t] = round(v[idx[j]*C + t] * scale), 0 past the end of v; one thread each."""
    e = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = np.float32(scale)
    n = v.size
    while e < out.size:
        j = e // chunk
        src = idx[j] * chunk + (e - j * chunk)
        x = v[src] * s if src < n else np.float32(0.0)
        if code == 0:
            out[e] = x
        else:
            out[e] = _round16(x, code)
        e += stride


@cuda.jit
def _unpack_kernel(v, r, has_r, red, red_code, loc, loc_code, has_loc, cmap, chunk,
                   unscale, err_scale, out):
    """Per element: scatter back the reduced value (0 if unsent) and update the residual."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    us = np.float32(unscale)
    es = np.float32(err_scale)
    while i < v.size:
        c = i // chunk
        j = cmap[c]
        x = v[i]
        if j < 0:
            if has_r:
                r[i] = x
            out[i] = np.float32(0.0)
        else:
            p = j * chunk + (i - c * chunk)
            if has_r:
                if has_loc:
                    r[i] = x - _mul(_load(loc, p, loc_code), es)
                else:
                    r[i] = np.float32(0.0)
            out[i] = _load(red, p, red_code) * us
        i += stride


@cuda.jit
def _cast_kernel(x, scale, code, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = np.float32(scale)
    while i < x.size:
        y = x[i] * s
        if code == 0:
            out[i] = y
        else:
            out[i] = _round16(y, code)
        i += stride


@cuda.jit
def _upcast_kernel(x, code, scale, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = np.float32(scale)
    while i < x.size:
        out[i] = _load(x, i, code) * s
        i += stride


# ---- launchers on device (or simulator numpy) arrays -----------------------------------------

_MAX_BLOCKS = 64 if SIMULATOR else 65535


def _blocks(n: int) -> int:
    return max(1, min(_MAX_BLOCKS, math.ceil(n / TPB)))


_DUMMIES: dict = {}


def _empty_f32(like):
    """A 1-element float32 array standing in for an absent optional argument (never read).

    Cached per device: an allocation per launch cost a cudaMalloc each time.
    """
    if SIMULATOR:
        return np.zeros(1, dtype=np.float32)
    dev = cuda.get_current_device().id
    arr = _DUMMIES.get(dev)
    if arr is None:
        arr = _DUMMIES[dev] = cuda.device_array(1, dtype=np.float32)
    return arr


def launch_chunk_norms(g, r, mom, mom_out, mode, m, chunk, l2, norms, stream=0, vout=None,
                       zero_g=False):
    """Launch the norms kernel; r/mom/mom_out/vout may be None; mode 0 plain, 1 momentum,
    2 Nesterov."""
    dummy = _empty_f32(g)
    nch = norms.shape[0]
    if nch == 0:
        return
    _norms_kernel[min(nch, _MAX_BLOCKS), TPB, stream](
        g, dummy if r is None else r, r is not None,
        dummy if mom is None else mom, dummy if mom_out is None else mom_out,
        mode, float(m), chunk, bool(l2), norms, g if vout is None else vout, bool(zero_g),
    )


def launch_pack(v, idx, chunk, scale, code, out, stream=0):
    """Launch the pack kernel (out: float32 for code 0, uint16 bits otherwise)."""
    if out.shape[0] == 0:
        return
    _pack_kernel[_blocks(out.shape[0]), TPB, stream](v, idx, chunk, float(scale), code, out)


def launch_unpack(v, r, red, red_code, loc, loc_code, cmap, chunk, unscale, err_scale, out,
                  stream=0):
    """Launch the unpack kernel; r and loc may be None; cmap[c] = position of chunk c or -1."""
    if v.shape[0] == 0:
        return
    dummy = _empty_f32(v)
    _unpack_kernel[_blocks(v.shape[0]), TPB, stream](
        v, dummy if r is None else r, r is not None,
        red, red_code, red if loc is None else loc, red_code if loc is None else loc_code,
        loc is not None, cmap, chunk, float(unscale), float(err_scale), out,
    )


def launch_cast(x, scale, code, out, stream=0):
    if x.shape[0]:
        _cast_kernel[_blocks(x.shape[0]), TPB, stream](x, float(scale), code, out)


def launch_upcast(x, code, scale, out, stream=0):
    if x.shape[0]:
        _upcast_kernel[_blocks(x.shape[0]), TPB, stream](x, code, float(scale), out)


# ---- torch-facing wrappers -------------------------------------------------------------------


def check_available() -> None:
    """Raise if numba's CUDA target cannot run kernels here (the dispatch then uses torch).

    A driver is not enough: the compiler (NVVM, numba-cuda's typing context) can still fail,
    so one tiny kernel is compiled here, once, instead of failing every CSC step later.
    """
    if SIMULATOR:
        raise RuntimeError("the CUDA simulator does not take torch tensors")
    if not cuda.is_available():
        raise RuntimeError("numba.cuda.is_available() is False")
    try:
        from numba import types

        _probe_kernel.compile((types.float32[::1], types.float32))
    except Exception as exc:
        raise RuntimeError(
            f"numba CUDA cannot compile a kernel here: {type(exc).__name__}: {exc}"
        ) from exc


@cuda.jit
def _probe_kernel(x, a):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = _mul(x[i], a) + a


def _code(dtype) -> int:
    import torch

    return {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}[dtype]


def _arr(t):
    """Zero-copy numba view of a CUDA tensor; 16-bit wire types as uint16 bits."""
    import torch

    if t.dtype in (torch.float16, torch.bfloat16):
        return cuda.as_cuda_array(t.detach().view(torch.int16), sync=False).view(np.uint16)
    return cuda.as_cuda_array(t.detach(), sync=False)


def _stream(t):
    import torch

    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


def chunk_norms(grad, residual, chunk_size, norm="l1", *, momentum=None, momentum_out=None,
                m=0.9, nesterov=False, v_out=None, zero_grad=False):
    """CUDA version of ``reference.chunk_norms``."""
    import torch

    nch = nchunks_of(grad.numel(), chunk_size)
    norms = torch.empty(nch, dtype=torch.float32, device=grad.device)
    with torch.cuda.device(grad.device):
        launch_chunk_norms(
            _arr(grad), None if residual is None else _arr(residual),
            None if momentum is None else _arr(momentum),
            None if momentum_out is None else _arr(momentum_out),
            0 if momentum is None else (2 if nesterov else 1), m, chunk_size, norm == "l2",
            _arr(norms), _stream(grad), None if v_out is None else _arr(v_out), zero_grad,
        )
    return norms


def pack_chunks(v, indices, chunk_size, scale, wire_dtype, *, out):
    """CUDA version of ``reference.pack_chunks`` (indices are trusted: checking costs a sync)."""
    import torch

    if indices.numel():
        with torch.cuda.device(v.device):
            launch_pack(_arr(v), _arr(indices), chunk_size, scale, _code(wire_dtype), _arr(out),
                        _stream(v))
    return out


def unpack_update(v, residual, packed_reduced, packed_local, indices, chunk_size, unscale,
                  err_scale, *, out):
    """CUDA version of ``reference.unpack_update``."""
    import torch

    nch = nchunks_of(v.numel(), chunk_size)
    # The chunk -> position map, built by torch on the same (current) stream.
    cmap = torch.full((nch,), -1, dtype=torch.int64, device=v.device)
    cmap[indices] = torch.arange(indices.numel(), device=v.device)
    with torch.cuda.device(v.device):
        launch_unpack(
            _arr(v), None if residual is None else _arr(residual),
            _arr(packed_reduced), _code(packed_reduced.dtype),
            None if packed_local is None else _arr(packed_local),
            _code(packed_reduced.dtype if packed_local is None else packed_local.dtype),
            _arr(cmap), chunk_size, unscale, err_scale, _arr(out), _stream(v),
        )
    return out


def cast_scaled(x, scale, wire_dtype, *, out):
    """CUDA version of ``reference.cast_scaled``."""
    import torch

    with torch.cuda.device(x.device):
        launch_cast(_arr(x), scale, _code(wire_dtype), _arr(out), _stream(x))
    return out


def upcast_scaled(x, scale, *, out):
    """CUDA version of ``reference.upcast_scaled``."""
    import torch

    with torch.cuda.device(x.device):
        launch_upcast(_arr(x), _code(x.dtype), scale, _arr(out), _stream(x))
    return out
