"""Pure-torch reference implementations of the CSC kernels (any device; the ground truth for tests).

Every function here has the semantics documented in ``gradientflow.kernels`` (the dispatch
module); the numba CPU and CUDA kernels must agree with these, element by element (norms within
float accumulation error, everything else bit for bit).

Conventions: 1-D contiguous float32 tensors of N elements cut into chunks of C elements;
``nchunks = ceil(N / C)``; the last chunk may be partial and is treated as zero-padded.
"""

from __future__ import annotations

import torch

__all__ = [
    "chunk_norms",
    "select_chunks",
    "pack_chunks",
    "unpack_update",
    "unpack_sent",
    "masked_chunk_norms",
    "dense_scatter",
    "all_finite",
    "cast_scaled",
    "upcast_scaled",
    "cast_feedback",
    "upcast_finite",
    "nchunks_of",
]

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _f32(scale) -> torch.Tensor:
    """A scale factor (a number, or a one-element float32 tensor) as a 0-dim float32 tensor."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).to(torch.float32)
    return torch.tensor(scale, dtype=torch.float32)


def nchunks_of(numel: int, chunk_size: int) -> int:
    """Return ceil(numel / chunk_size), the number of chunks of a flat buffer."""
    return -(-numel // chunk_size)


def chunk_norms(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    chunk_size: int,
    norm: str = "l1",
    *,
    momentum: torch.Tensor | None = None,
    momentum_out: torch.Tensor | None = None,
    m: float = 0.9,
    nesterov: bool = False,
    v_out: torch.Tensor | None = None,
    zero_grad: bool = False,
) -> torch.Tensor:
    """Add the residual (and momentum) into ``grad`` (or ``v_out``) and return each chunk's norm.

    See ``gradientflow.kernels.chunk_norms`` for the contract. "l2" returns the *squared* L2
    norm (sum of v*v): the ranking is the same and the square root is not needed.
    """
    if momentum is not None:
        if nesterov:
            u = (momentum + grad) * m
        else:
            u = momentum * m + grad
        v = u if residual is None else residual + u
        if nesterov:
            v = v + grad
        momentum_out.copy_(u)
    else:
        v = grad if residual is None else grad + residual
    dst = grad if v_out is None else v_out
    if v is not dst:
        dst.copy_(v)
    if zero_grad:
        grad.zero_()
    n = grad.numel()
    full = n // chunk_size
    out = grad.new_empty(nchunks_of(n, chunk_size))
    # Full chunks through a view and the partial tail on its own: no padded copy of the gradient.
    parts = [(dst[: full * chunk_size].view(full, chunk_size), out[:full])]
    if full * chunk_size < n:
        parts.append((dst[full * chunk_size :].view(1, -1), out[full:]))
    for mat, dst in parts:
        if norm == "l1":
            torch.sum(mat.abs(), dim=1, out=dst)
        else:
            torch.sum(mat * mat, dim=1, out=dst)
    return out


def select_chunks(
    norms: torch.Tensor, k: int, *, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Return the indices of the top-k chunks by norm (plus the forced ones), sorted ascending.

    Ties go to the lower index and NaN ranks as +inf, so every rank holding the same reduced
    norms picks the same chunks, and a non-finite chunk is always sent.
    """
    key = norms.detach().to(torch.float32).clone()
    key[torch.isnan(key)] = float("inf")
    idx = torch.arange(key.numel(), device=key.device)
    if forced is not None:
        forced = forced.to(device=key.device, dtype=torch.bool)
        free = idx[~forced]
        key = key[free]
        k = min(k, free.numel())
    else:
        free = idx
    # A stable descending sort keeps equal keys in index order: the deterministic tie-break.
    order = torch.sort(key, descending=True, stable=True).indices[:k]
    chosen = free[order]
    if forced is not None:
        chosen = torch.cat([chosen, idx[forced]])
    return torch.sort(chosen).values.to(torch.int64)


def pack_chunks(
    v: torch.Tensor,
    indices: torch.Tensor,
    chunk_size: int,
    scale: float,
    wire_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the chunks ``indices`` of v, multiply by ``scale`` and cast to ``wire_dtype``."""
    k = indices.numel()
    if out is None:
        out = torch.empty(k * chunk_size, dtype=wire_dtype, device=v.device)
    if k == 0:
        return out
    rows = _gather_rows(v, indices.to(device=v.device, dtype=torch.int64), chunk_size)
    # Multiply in float32 first, then one rounding to the wire type (as the kernels do).
    rows.mul_(_f32(scale))
    out.view(k, chunk_size).copy_(rows)
    return out


def unpack_update(
    v: torch.Tensor,
    residual: torch.Tensor | None,
    packed_reduced: torch.Tensor,
    packed_local: torch.Tensor | None,
    indices: torch.Tensor,
    chunk_size: int,
    unscale: float,
    err_scale: float,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """Scatter the reduced chunks into ``out`` (zeros elsewhere); keep the rest in ``residual``."""
    # v goes into the residual whole, then the sent chunks take their rounding error off it:
    # the same arithmetic as unpack_sent on a residual that already holds v.
    if residual is not None:
        residual.copy_(v)
    # out may alias v: everything read from v is already in the residual.
    out.zero_()
    return unpack_sent(out, residual, packed_reduced, packed_local, indices, chunk_size,
                       unscale, err_scale)


def unpack_sent(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    packed_reduced: torch.Tensor,
    packed_local: torch.Tensor | None,
    indices: torch.Tensor,
    chunk_size: int,
    unscale: float,
    err_scale: float,
) -> torch.Tensor:
    """Write the reduced chunks into ``out``, their rounding error into ``residual``; only those.

    In sent chunk j: ``out = upcast(reduced_j) * unscale`` and ``residual = residual -
    upcast(local_j) * err_scale`` (0 without ``packed_local``). Nothing else is touched.
    """
    k = indices.numel()
    if k == 0:
        return out
    idx = indices.to(device=out.device, dtype=torch.int64)
    if residual is not None:
        if packed_local is None:
            mat = torch.zeros(k, chunk_size, dtype=torch.float32, device=out.device)
        else:
            loc = packed_local.view(k, chunk_size).to(torch.float32)
            err = loc * _f32(err_scale)
            mat = _gather_rows(residual, idx, chunk_size) - err
        _scatter_rows(residual, idx, mat, chunk_size)
    red = (packed_reduced.view(k, chunk_size).to(torch.float32)
           * _f32(unscale))
    _scatter_rows(out, idx, red, chunk_size)
    return out


def masked_chunk_norms(
    v: torch.Tensor, chunks: torch.Tensor, keep: torch.Tensor, chunk_size: int, norm: str, *,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[chunks[m]] = the norm of chunk chunks[m] of v over only the elements where keep[m]."""
    m = chunks.numel()
    if m == 0:
        return out
    n = v.numel()
    pos = (chunks.to(torch.int64)[:, None] * chunk_size
           + torch.arange(chunk_size, device=v.device)[None, :])
    inside = pos < n
    vals = v.index_select(0, pos.clamp(max=n - 1).reshape(-1)).view(m, chunk_size)
    vals = vals.abs() if norm == "l1" else vals * vals
    out[chunks] = torch.where(keep & inside, vals, vals.new_zeros(())).sum(dim=1)
    return out


def dense_scatter(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    idx: torch.Tensor,
    reduced: torch.Tensor,
    local: torch.Tensor | None,
    v: torch.Tensor,
    unscale: float,
    err_scale: float,
) -> torch.Tensor:
    """out[idx] = upcast(reduced) * unscale; residual[idx] = v - upcast(local) * err_scale."""
    if idx.numel() == 0:
        return out
    out.index_copy_(0, idx, reduced.to(torch.float32) * _f32(unscale))
    if residual is not None:
        err = v - local.to(torch.float32) * _f32(err_scale)
        residual.index_copy_(0, idx, err)
    return out


def all_finite(x: torch.Tensor) -> bool:
    """Return whether no element of x is inf or NaN."""
    return bool(torch.isfinite(x).all())


def _gather_rows(x: torch.Tensor, idx: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Return the chunks idx of x as a (k, C) float32 matrix, the partial last chunk zero-padded."""
    n = x.numel()
    full = n // chunk_size
    rows = torch.empty(idx.numel(), chunk_size, dtype=torch.float32, device=x.device)
    if idx.numel() == 0:
        return rows
    if full > 0:
        body = x[: full * chunk_size].view(full, chunk_size)
        torch.index_select(body, 0, idx.clamp(max=full - 1), out=rows)
    if full * chunk_size < n:
        tail = x.new_zeros(chunk_size)
        tail[: n - full * chunk_size] = x[full * chunk_size :]
        rows[idx >= full] = tail
    return rows


def _scatter_rows(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor,
                  chunk_size: int) -> None:
    """Write rows[j] into dst's chunk idx[j], cutting the part past the end of dst."""
    n = dst.numel()
    full = n // chunk_size
    is_full = idx < full
    if full > 0 and bool(is_full.any()):
        dst[: full * chunk_size].view(full, chunk_size)[idx[is_full]] = rows[is_full]
    if full * chunk_size < n and bool((~is_full).any()):
        dst[full * chunk_size :] = rows[~is_full][0, : n - full * chunk_size]


def cast_scaled(
    x: torch.Tensor, scale: float, wire_dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Return cast(x * scale) in ``wire_dtype`` (one float32 multiply, one rounding)."""
    if out is None:
        out = torch.empty(x.numel(), dtype=wire_dtype, device=x.device)
    out.copy_(x * _f32(scale))
    return out


def upcast_scaled(x: torch.Tensor, scale: float, *, out: torch.Tensor) -> torch.Tensor:
    """Write float32(x) * scale into ``out`` (float32)."""
    torch.mul(x.to(torch.float32), _f32(scale), out=out)
    return out


def cast_feedback(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    scale: float,
    wire_dtype: torch.dtype,
    err_scale: float,
    *,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> torch.Tensor:
    """``v = x + residual``; ``out = cast(v * scale)``; ``residual_out = v - out * err_scale``."""
    v = x if residual is None else x + residual
    out.copy_(v * _f32(scale))
    if residual_out is not None:
        torch.sub(v, out.to(torch.float32) * _f32(err_scale),
                  out=residual_out)
    return out


def upcast_finite(x: torch.Tensor, scale: float, *, out: torch.Tensor) -> bool:
    """Write ``float32(x) * scale`` into ``out``; return whether every element of it is finite."""
    upcast_scaled(x, scale, out=out)
    return bool(torch.isfinite(out).all())
