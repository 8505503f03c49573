"""Triton kernels of CSC for CUDA tensors: each CSC pass is one fused launch, selection included.

Imported lazily by the dispatch module (``kernels/__init__.py``) for CUDA tensors; preferred
over the numba CUDA kernels (``cuda.py``) where Triton loads, because a Triton launch costs the
host far less than a numba-cuda launch (which builds a device-array view of every argument on
every call) and a CSC step on a GPU is short enough for launch overhead to dominate it
(benchmarks/results/gpu_check/).
Under ``TRITON_INTERPRET=1`` the same functions run on CPU tensors through Triton's interpreter:
that is how the tests check them on a machine without a GPU (tests/kernels/test_triton.py).

The passes, each one launch (the contract of each function is the dispatch module's):

- ``chunk_norms``: residual (+ momentum, + Nesterov) folded into v, v stored (into the gradient
  or a spare buffer, the gradient zeroed in the same pass) and every chunk's norm reduced, over
  tiles of whole chunks: one read of each input, one write of each output;
- ``select_chunks``: the k-th largest norm from ``torch.topk`` (no full sort), then two passes
  over blocks of norms (count above and equal; write each block's share at its offset) write
  the indices above it and the lowest-index ties, ascending: exactly the reference's
  stable-sort choice, with nothing read back by the host;
- ``pack_chunks``: gather, scale and cast to the wire type of the chosen chunks;
- ``unpack_sent``: the sent chunks' reduced values into the output and their rounding error
  into the residual; ``unpack_update`` the same over the whole buffer;
- ``cast_scaled`` / ``upcast_scaled``: the dense wire cast and its inverse.

Bit-for-bit agreement with the torch reference: every launch passes ``enable_fp_fusion=False``,
so ``a * b + c`` is two roundings as in torch's separate kernels, not one fused multiply-add;
casts to binary16 round to nearest even, as torch's do; bfloat16 is rounded and widened by
integer arithmetic on its bits (``_bf16_bits``, ``_load_wire``), so the interpreter, whose own
bfloat16 cast truncates, computes what the GPU does. Only the norms differ from torch's sums,
by the order of the additions.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .reference import nchunks_of

__all__ = [
    "chunk_norms",
    "select_chunks",
    "pack_chunks",
    "unpack_sent",
    "unpack_update",
    "cast_scaled",
    "upcast_scaled",
    "check_available",
]

# Elements one program of the tiled passes handles: with 8 warps, 32 per thread, enough bytes
# in flight per thread to keep the memory system busy (the fastest of the tiles gpu_check times).
_TILE = 8192
_TILE_WARPS = 8  # warps per program of the tiled passes
_ELEMWISE_BLOCK = 4096
_SELECT_BLOCK = 1024  # keys per program of the selection
_SELECT_SCAN = 256  # blocks' counts each selection program reads at a time
_LAUNCH = dict(enable_fp_fusion=False)  # no contraction of a*b+c: torch rounds twice


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _tiles(nch: int, chunk: int) -> tuple[int, int]:
    """(rows, columns) of a chunk tile: whole chunks per program, columns a power of two."""
    block_c = min(_next_pow2(chunk), 1024)
    rows = max(1, min(_TILE // block_c, _next_pow2(nch)))
    return rows, block_c


def _launch_rows(kernel, n: int, chunk: int, args: tuple, **consts) -> None:
    """Launch a tiled pass over the chunks of n elements: the full chunks first, then the
    partial last chunk alone, so that the first launch's loads need no mask past n (with a
    chunk that is a multiple of 16 they are then 16-byte vector loads)."""
    full, nch = n // chunk, nchunks_of(n, chunk)
    for row0, rows_in, exact in ((0, full, True), (full, nch - full, False)):
        if rows_in:
            rows, block_c = _tiles(rows_in, chunk)
            kernel[(triton.cdiv(rows_in, rows),)](
                *args, n, row0, row0 + rows_in, chunk, EXACT=exact,
                EVEN_C=chunk % block_c == 0, ROWS=rows, BLOCK_C=block_c, **consts,
                num_warps=_TILE_WARPS, **_LAUNCH)


_WIRE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _wire(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A wire buffer as the kernels take it, with its code: bfloat16 as its int16 bits."""
    code = _WIRE[t.dtype]
    return (t.view(torch.int16) if code == 2 else t), code


@triton.jit
def _bf16_bits(x):
    """float32 -> bfloat16 bits (int16), rounded to nearest even; NaN stays NaN."""
    b = x.to(tl.int32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, (b >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _store_wire(ptr, x, mask, WIRE: tl.constexpr):
    """Store float32 x rounded to the wire type (0 float32, 1 binary16, 2 bfloat16 bits)."""
    if WIRE == 2:
        tl.store(ptr, _bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_wire(ptr, mask, WIRE: tl.constexpr):
    """Load a wire buffer's elements as float32 (bfloat16 widened from its bits)."""
    if WIRE == 2:
        b = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


def _factor(scale) -> tuple:
    """A scale factor as a kernel argument and its flag: a 0-dim device tensor is passed as a
    pointer and read by the kernel (so the host never waits for what computed it), a number as
    a float32 value."""
    if isinstance(scale, torch.Tensor):
        return scale, True
    return float(scale), False


@triton.jit
def _read(x, IS_PTR: tl.constexpr):
    """A scale factor passed by `_factor`: loaded where it is a pointer."""
    if IS_PTR:
        return tl.load(x)
    else:
        return x


def _device(t: torch.Tensor):
    """Launch on t's device (Triton launches on the current device's current stream)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---- chunk norms ----------------------------------------------------------------------------


@triton.jit
def _tile_mask(row_ok, cols, off, n, C, EXACT: tl.constexpr, EVEN_C: tl.constexpr):
    """Which elements of a [rows, columns] tile of chunks exist."""
    mask = row_ok[:, None]
    if not EVEN_C:
        mask = mask & (cols[None, :] < C)
    if not EXACT:
        mask = mask & (off < n)
    return mask


@triton.jit
def _norms_kernel(g, r, mom, mom_out, v, norms, m, n, row0, row_end, C,
                  MODE: tl.constexpr, HAS_R: tl.constexpr, SEP_V: tl.constexpr,
                  ZERO_G: tl.constexpr, L2: tl.constexpr, EXACT: tl.constexpr,
                  EVEN_C: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = row0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < row_end
    base = rows.to(tl.int64) * C
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        off = base[:, None] + cols[None, :]
        mask = _tile_mask(row_ok, cols, off, n, C, EXACT, EVEN_C)
        x = tl.load(g + off, mask=mask, other=0.0)
        if MODE == 0:
            if HAS_R:
                val = x + tl.load(r + off, mask=mask, other=0.0)
            else:
                val = x
        elif MODE == 1:  # momentum correction: u = m * mom + g; v = r + u
            u = tl.load(mom + off, mask=mask, other=0.0) * m + x
            tl.store(mom_out + off, u, mask=mask)
            if HAS_R:
                val = tl.load(r + off, mask=mask, other=0.0) + u
            else:
                val = u
        else:  # Nesterov: u = (mom + g) * m; v = r + u + g
            u = (tl.load(mom + off, mask=mask, other=0.0) + x) * m
            tl.store(mom_out + off, u, mask=mask)
            if HAS_R:
                val = (tl.load(r + off, mask=mask, other=0.0) + u) + x
            else:
                val = u + x
        if SEP_V:
            tl.store(v + off, val, mask=mask)
            if ZERO_G:
                tl.store(g + off, tl.zeros_like(val), mask=mask)
        else:
            tl.store(g + off, val, mask=mask)
        if L2:
            acc += tl.sum(val * val, axis=1)
        else:
            acc += tl.sum(tl.abs(val), axis=1)
    tl.store(norms + rows, acc, mask=row_ok)


def chunk_norms(grad, residual, chunk_size, norm="l1", *, momentum=None, momentum_out=None,
                m=0.9, nesterov=False, v_out=None, zero_grad=False):
    """Triton version of ``reference.chunk_norms`` (one pass)."""
    n = grad.numel()
    nch = nchunks_of(n, chunk_size)
    norms = torch.empty(nch, dtype=torch.float32, device=grad.device)
    if nch == 0:
        return norms
    mode = 0 if momentum is None else (2 if nesterov else 1)
    args = (grad, grad if residual is None else residual, grad if momentum is None else momentum,
            grad if momentum_out is None else momentum_out, grad if v_out is None else v_out,
            norms, float(m))
    with _device(grad):
        _launch_rows(_norms_kernel, n, chunk_size, args, MODE=mode, HAS_R=residual is not None,
                     SEP_V=v_out is not None, ZERO_G=bool(zero_grad), L2=norm == "l2")
    return norms


# ---- selection ------------------------------------------------------------------------------


@triton.jit
def _key(x):
    """A norm as the selection ranks it: NaN as +inf."""
    return tl.where(x != x, float("inf"), x)


@triton.jit
def _threshold(top, k, KB: tl.constexpr):
    """The k-th largest key: the smallest of the top k (torch.topk's values, unordered; topk
    ranks NaN above +inf, and both are +inf as keys, so its k-th is the keys' k-th)."""
    j = tl.arange(0, KB)
    low = tl.zeros([], dtype=tl.float32) + float("inf")
    for s in range(0, k, KB):
        top_s = _key(tl.load(top + s + j, mask=s + j < k, other=float("inf")))
        low = tl.minimum(low, tl.min(top_s, axis=0))
    return low


@triton.jit
def _select_count_kernel(key, top, counts, n, k, nblocks, BLOCK: tl.constexpr,
                         KB: tl.constexpr):
    """Per block of keys: how many are above the threshold, and how many equal it."""
    b = tl.program_id(0)
    thr = _threshold(top, k, KB)
    i = b * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = _key(tl.load(key + i, mask=inside, other=float("-inf")))
    tl.store(counts + b, tl.sum(((x > thr) & inside).to(tl.int32), axis=0))
    tl.store(counts + nblocks + b, tl.sum(((x == thr) & inside).to(tl.int32), axis=0))


@triton.jit
def _select_write_kernel(key, top, counts, out, n, k, nblocks, BLOCK: tl.constexpr,
                         SCAN: tl.constexpr, KB: tl.constexpr):
    """Per block: its keys above the threshold, and the ties the quota leaves room for (the
    lowest-index ones first), written at their place in the ascending output."""
    b = tl.program_id(0)
    thr = _threshold(top, k, KB)
    # From every block's counts: all the keys above the threshold, those in earlier blocks,
    # and the ties in earlier blocks (a few blocks per program: cheap beside a sort).
    above = 0
    above_before = 0
    ties_before = 0
    for s in range(0, nblocks, SCAN):
        j = s + tl.arange(0, SCAN)
        gt = tl.load(counts + j, mask=j < nblocks, other=0)
        eq = tl.load(counts + nblocks + j, mask=j < nblocks, other=0)
        above += tl.sum(gt, axis=0)
        above_before += tl.sum(tl.where(j < b, gt, 0), axis=0)
        ties_before += tl.sum(tl.where(j < b, eq, 0), axis=0)
    ties_wanted = k - above
    i = b * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = _key(tl.load(key + i, mask=inside, other=float("-inf")))
    gt = (x > thr) & inside
    eq = (x == thr) & inside
    tie_rank = ties_before + tl.cumsum(eq.to(tl.int32), axis=0)
    take = gt | (eq & (tie_rank <= ties_wanted))
    base = above_before + tl.minimum(tl.maximum(ties_wanted, 0), ties_before)
    pos = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out + pos, i.to(tl.int64), mask=take)


def select_chunks(norms, k, *, forced=None):
    """Top-k chunks, ties to the lower index, NaN as +inf, ascending: no full sort, no sync."""
    if forced is not None:
        from . import reference

        return reference.select_chunks(norms, k, forced=forced)
    nch = norms.numel()
    if k >= nch:
        return torch.arange(nch, dtype=torch.int64, device=norms.device)
    out = torch.empty(k, dtype=torch.int64, device=norms.device)
    if k == 0:
        return out
    # NaN is ranked as +inf by the kernels as they load (`_key`): no pass of its own.
    key = norms.detach().to(torch.float32)
    top = torch.topk(key, k, sorted=False).values  # its smallest is the threshold (in-kernel)
    nblocks = triton.cdiv(nch, _SELECT_BLOCK)
    counts = torch.empty(2 * nblocks, dtype=torch.int32, device=norms.device)
    kb = min(_next_pow2(k), 1024)
    with _device(norms):
        _select_count_kernel[(nblocks,)](key, top, counts, nch, k, nblocks, BLOCK=_SELECT_BLOCK,
                                         KB=kb, **_LAUNCH)
        _select_write_kernel[(nblocks,)](key, top, counts, out, nch, k, nblocks,
                                         BLOCK=_SELECT_BLOCK, SCAN=_SELECT_SCAN, KB=kb, **_LAUNCH)
    return out


# ---- pack and unpack ------------------------------------------------------------------------


@triton.jit
def _pack_kernel(v, idx, out, n, C, scale, SCALE_PTR: tl.constexpr, WIRE: tl.constexpr,
                 BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    src = tl.load(idx + j).to(tl.int64) * C + cols
    x = tl.load(v + src, mask=col_ok & (src < n), other=0.0) * _read(scale, SCALE_PTR)
    _store_wire(out + j.to(tl.int64) * C + cols, x, col_ok, WIRE)


def pack_chunks(v, indices, chunk_size, scale, wire_dtype, *, out):
    """Triton version of ``reference.pack_chunks`` (indices trusted: checking costs a sync)."""
    k = indices.numel()
    if k:
        block = min(_next_pow2(chunk_size), 1024)
        bits, code = _wire(out)
        scale, scale_ptr = _factor(scale)
        with _device(v):
            _pack_kernel[(k, triton.cdiv(chunk_size, block))](
                v, indices, bits, v.numel(), chunk_size, scale, SCALE_PTR=scale_ptr, WIRE=code,
                BLOCK=block, **_LAUNCH)
    return out


@triton.jit
def _unpack_sent_kernel(out, r, red, loc, idx, n, C, unscale, err_scale,
                        UNSCALE_PTR: tl.constexpr, ERR_PTR: tl.constexpr,
                        HAS_R: tl.constexpr, HAS_LOC: tl.constexpr, RED: tl.constexpr,
                        LOC: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dst = tl.load(idx + j).to(tl.int64) * C + cols
    mask = (cols < C) & (dst < n)
    src = j.to(tl.int64) * C + cols
    if HAS_R:
        if HAS_LOC:
            err = _load_wire(loc + src, mask, LOC) * _read(err_scale, ERR_PTR)
            tl.store(r + dst, tl.load(r + dst, mask=mask, other=0.0) - err, mask=mask)
        else:
            tl.store(r + dst, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
    red_v = _load_wire(red + src, mask, RED) * _read(unscale, UNSCALE_PTR)
    tl.store(out + dst, red_v, mask=mask)


def unpack_sent(out, residual, packed_reduced, packed_local, indices, chunk_size, unscale,
                err_scale):
    """Triton version of ``reference.unpack_sent``: only the k sent chunks are touched."""
    k = indices.numel()
    if k:
        block = min(_next_pow2(chunk_size), 1024)
        red, red_code = _wire(packed_reduced)
        loc, loc_code = _wire(packed_reduced if packed_local is None else packed_local)
        (unscale, unscale_ptr), (err_scale, err_ptr) = _factor(unscale), _factor(err_scale)
        with _device(out):
            _unpack_sent_kernel[(k, triton.cdiv(chunk_size, block))](
                out, out if residual is None else residual, red, loc, indices,
                out.numel(), chunk_size, unscale, err_scale, UNSCALE_PTR=unscale_ptr,
                ERR_PTR=err_ptr, HAS_R=residual is not None, HAS_LOC=packed_local is not None,
                RED=red_code, LOC=loc_code, BLOCK=block, **_LAUNCH)
    return out


@triton.jit
def _unpack_update_kernel(v, r, red, loc, cmap, out, unscale, err_scale, n, row0, row_end, C,
                          UNSCALE_PTR: tl.constexpr, ERR_PTR: tl.constexpr,
                          HAS_R: tl.constexpr, HAS_LOC: tl.constexpr, RED: tl.constexpr,
                          LOC: tl.constexpr, EXACT: tl.constexpr, EVEN_C: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = row0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < row_end
    pos = tl.load(cmap + rows, mask=row_ok, other=-1)
    sent = (pos >= 0)[:, None]
    base = rows.to(tl.int64) * C
    us = _read(unscale, UNSCALE_PTR)
    es = _read(err_scale, ERR_PTR)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        off = base[:, None] + cols[None, :]
        mask = _tile_mask(row_ok, cols, off, n, C, EXACT, EVEN_C)
        src = pos[:, None] * C + cols[None, :]
        smask = mask & sent
        x = tl.load(v + off, mask=mask, other=0.0)
        red_v = _load_wire(red + src, smask, RED) * us
        if HAS_R:
            if HAS_LOC:
                err = _load_wire(loc + src, smask, LOC) * es
                kept = x - err
            else:
                kept = tl.zeros_like(x)
            tl.store(r + off, tl.where(sent, kept, x), mask=mask)
        tl.store(out + off, tl.where(sent, red_v, 0.0), mask=mask)


def unpack_update(v, residual, packed_reduced, packed_local, indices, chunk_size, unscale,
                  err_scale, *, out):
    """Triton version of ``reference.unpack_update`` (one pass over the whole buffer)."""
    n = v.numel()
    nch = nchunks_of(n, chunk_size)
    if nch == 0:
        return out
    # The chunk -> position map, built by torch on the same (current) stream.
    cmap = torch.full((nch,), -1, dtype=torch.int64, device=v.device)
    cmap[indices] = torch.arange(indices.numel(), device=v.device)
    red, red_code = _wire(packed_reduced)
    loc, loc_code = _wire(packed_reduced if packed_local is None else packed_local)
    (unscale, unscale_ptr), (err_scale, err_ptr) = _factor(unscale), _factor(err_scale)
    args = (v, v if residual is None else residual, red, loc, cmap, out, unscale, err_scale)
    with _device(v):
        _launch_rows(_unpack_update_kernel, n, chunk_size, args, UNSCALE_PTR=unscale_ptr,
                     ERR_PTR=err_ptr, HAS_R=residual is not None,
                     HAS_LOC=packed_local is not None, RED=red_code, LOC=loc_code)
    return out


# ---- dense casts ----------------------------------------------------------------------------


@triton.jit
def _scale_cast_kernel(x, out, n, scale, SCALE_PTR: tl.constexpr, IN: tl.constexpr,
                       OUT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = _load_wire(x + i, i < n, IN) * _read(scale, SCALE_PTR)
    _store_wire(out + i, y, i < n, OUT)


def _scale_cast(x, scale, out):
    """out = cast(float32(x) * scale), one rounding, for any pair of wire types."""
    n = x.numel()
    if n:
        src, in_code = _wire(x)
        dst, out_code = _wire(out)
        scale, scale_ptr = _factor(scale)
        with _device(x):
            _scale_cast_kernel[(triton.cdiv(n, _ELEMWISE_BLOCK),)](
                src, dst, n, scale, SCALE_PTR=scale_ptr, IN=in_code, OUT=out_code,
                BLOCK=_ELEMWISE_BLOCK, **_LAUNCH)
    return out


def cast_scaled(x, scale, wire_dtype, *, out):
    """Triton version of ``reference.cast_scaled``: one multiply, one rounding."""
    return _scale_cast(x, scale, out)


def upcast_scaled(x, scale, *, out):
    """Triton version of ``reference.upcast_scaled``."""
    return _scale_cast(x, scale, out)


# ---- availability ---------------------------------------------------------------------------


def check_available() -> None:
    """Raise unless Triton can compile and run a kernel on this machine's GPU.

    A driver is not enough (a Triton without the GPU's backend, or no compiler), so a tiny
    kernel is run once here instead of failing every CSC step later.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    x = torch.ones(8, device="cuda")
    out = torch.empty(8, device="cuda")
    _scale_cast(x, 2.0, out)
    if not bool((out == 2).all()):
        raise RuntimeError("a Triton probe kernel ran but computed the wrong values")
