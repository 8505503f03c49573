"""The contract of every kernel op: its public signature, its docstring and its argument checks.

Each function here has the signature of the public op of the same name (without ``impl``, which
the dispatcher takes), refuses bad arguments with a sentence that names the op, the argument and
what to pass instead, and returns the call every implementation (reference, cpu, cuda) takes:
``(args, kwargs)``, with optional outputs allocated and scalars made plain Python numbers, except
a scale factor given as a one-element tensor for CUDA data, which stays one (``_scale``). The
first positional argument of that call is the tensor whose device picks the implementation.

Why here: the implementations then trust their arguments (except chunk indices, which the numba
kernels range-check because a bad one would write out of bounds), and the checks are written
once for all three.
"""

from __future__ import annotations

from typing import Any

import torch

from .reference import WIRE_DTYPES, nchunks_of

Call = tuple[tuple[Any, ...], dict[str, Any]]

_NORMS = ("l1", "l2")


def _flat(op: str, name: str, t, dtype=torch.float32, numel=None, device=None) -> None:
    """Refuse a tensor that is not a 1-D contiguous tensor of ``dtype`` (and size/device)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be a 1-D contiguous tensor, got shape {tuple(t.shape)} "
            f"(contiguous={t.is_contiguous()}); pass a flat buffer, e.g. t.contiguous().view(-1)"
        )
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{op}: {name} must have {numel} elements, got {t.numel()}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the gradient is on {device}")


def _wire(op: str, name: str, t, numel=None, device=None) -> None:
    """Refuse a wire buffer: 1-D contiguous, one of the wire dtypes."""
    _flat(op, name, t, dtype=None)
    if t.dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: {name} must be one of {WIRE_DTYPES}, got {t.dtype}")
    _flat(op, name, t, dtype=None, numel=numel, device=device)


def _wire_dtype(op: str, wire_dtype) -> None:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")


def _out(op: str, out, wire_dtype, n: int, device):
    """Return ``out`` checked, or a new ``wire_dtype`` tensor of n elements."""
    if out is None:
        return torch.empty(n, dtype=wire_dtype, device=device)
    _flat(op, "out", out, dtype=wire_dtype, numel=n, device=device)
    return out


def _scale(op: str, name: str, value, device: torch.device):
    """A scale factor: a number, or a one-element float32 tensor on the data's device.

    On CUDA a tensor is passed on as a 0-dim tensor, so that the kernels read it from device
    memory and the host never waits for whatever computed it (an agreed wire scale); elsewhere
    it is read at once (no wait to speak of).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32 or value.device != device:
            raise ValueError(
                f"{op}: {name} must be a number or a one-element float32 tensor on {device}, "
                f"got a {value.dtype} tensor of {value.numel()} elements on {value.device}")
        return value.reshape(()) if device.type == "cuda" else float(value)
    return float(value)


def _chunk(op: str, chunk_size) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be an int >= 1, got {chunk_size!r}")


def _norm(op: str, norm) -> None:
    if norm not in _NORMS:
        raise ValueError(f"{op}: norm must be one of {_NORMS}, got {norm!r}")


def _indices(op: str, indices, nch: int, device) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(
            f"{op}: indices must be a 1-D torch.int64 tensor (as select_chunks returns), "
            f"got {getattr(indices, 'dtype', type(indices))}"
        )
    if indices.device != device:
        raise ValueError(f"{op}: indices are on {indices.device} but the gradient is on {device}")
    if indices.numel() > nch:
        raise ValueError(f"{op}: {indices.numel()} indices for only {nch} chunks")


def _unpack(op, target, name, residual, packed_reduced, packed_local, indices, chunk_size):
    """An unpack's inputs: the flat target, the chunk indices, the packed chunks (wire dtypes,
    k * chunk_size elements) and the residual."""
    _flat(op, name, target)
    dev, n = target.device, target.numel()
    _chunk(op, chunk_size)
    _indices(op, indices, nchunks_of(n, chunk_size), dev)
    packed_numel = indices.numel() * chunk_size
    for label, packed in (("packed_reduced", packed_reduced), ("packed_local", packed_local)):
        if packed is not None:
            _wire(op, label, packed, numel=packed_numel, device=dev)
    if residual is not None:
        _flat(op, "residual", residual, numel=n, device=dev)
        if residual.data_ptr() == target.data_ptr() and n:
            raise ValueError(f"{op}: residual must not be {name} itself")


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
) -> Call:
    """Fold the residual (and DGC momentum) into ``grad`` (or ``v_out``); return each chunk's norm.

    One read of the gradient. Without momentum: ``v = grad + residual``. With momentum
    correction (``momentum`` given): ``u = m * momentum + grad`` and ``v = residual + u``; with
    ``nesterov``: ``u = (momentum + grad) * m`` and ``v = residual + u + grad``. ``u`` is written
    into ``momentum_out`` (which may be ``momentum`` itself). ``v`` is written into ``grad``, or
    into ``v_out`` when given; ``residual`` is not modified unless it is ``v_out`` (an update in
    place, which the caller cannot undo; otherwise it can undo a non-finite step). With
    ``zero_grad`` (only beside a ``v_out``) ``grad`` is zeroed in the same pass: a compressor
    that keeps v in its spare residual buffer then only writes the sent chunks into ``grad``
    afterwards (``unpack_sent``), instead of a second full pass (``unpack_update``).

    Args:
        grad: float32 gradient, N elements; overwritten with v.
        residual: float32, N elements, or None (no error feedback: v = grad).
        chunk_size: C >= 1.
        norm: "l1" (sum of |v|) or "l2" (sum of v*v: the SQUARED L2 norm; same ranking).
        momentum, momentum_out: float32, N elements, both or neither.
        m: momentum factor. nesterov: Nesterov variant.
        v_out: float32, N elements, or None (v goes into grad); not grad, momentum or
            momentum_out (each element is read before it is written, so residual may be it).
        zero_grad: set grad to zeros (needs v_out).
        impl: "auto" | "numba" | "torch".

    Returns:
        float32 tensor of ``nchunks`` norms on grad's device (NaN/inf where v is non-finite).
    """
    op = "chunk_norms"
    _flat(op, "grad", grad)
    n, dev = grad.numel(), grad.device
    _chunk(op, chunk_size)
    _norm(op, norm)
    if residual is not None:
        _flat(op, "residual", residual, numel=n, device=dev)
    if (momentum is None) != (momentum_out is None):
        raise ValueError(f"{op}: pass both momentum and momentum_out, or neither")
    if momentum is not None:
        _flat(op, "momentum", momentum, numel=n, device=dev)
        _flat(op, "momentum_out", momentum_out, numel=n, device=dev)
    if v_out is not None:
        _flat(op, "v_out", v_out, numel=n, device=dev)
        if n and any(t is not None and t.data_ptr() == v_out.data_ptr()
                     for t in (grad, momentum, momentum_out)):
            raise ValueError(
                f"{op}: v_out must not be grad or momentum (v_out=None writes v into grad; "
                "v_out may be the residual, updated in place)"
            )
    elif zero_grad:
        raise ValueError(
            f"{op}: zero_grad=True needs a v_out (v would be lost with grad); pass both"
        )
    return (grad, residual, chunk_size, norm), dict(
        momentum=momentum, momentum_out=momentum_out, m=float(m), nesterov=bool(nesterov),
        v_out=v_out, zero_grad=bool(zero_grad),
    )


def select_chunks(norms: torch.Tensor, k: int, *, forced: torch.Tensor | None = None) -> Call:
    """Return the top-k chunks by norm, ties to the lower index, sorted ascending (int64).

    NaN norms rank as +inf, so a non-finite chunk is always chosen, the same on every rank.
    ``forced`` (bool, one per chunk) marks chunks that are always included and do not count in
    k; k is then capped at the number of chunks not forced.
    """
    op = "select_chunks"
    _flat(op, "norms", norms, dtype=None)
    if not norms.is_floating_point():
        raise ValueError(f"{op}: norms must be a floating tensor, got {norms.dtype}")
    nch = norms.numel()
    if not isinstance(k, int) or not 0 <= k <= nch:
        raise ValueError(
            f"{op}: k must be an int in [0, {nch}] (the number of chunks), got {k!r}"
        )
    if forced is not None and (forced.dtype != torch.bool or forced.numel() != nch):
        raise ValueError(
            f"{op}: forced must be a bool tensor with one entry per chunk ({nch}), "
            f"got {forced.dtype} with {forced.numel()}"
        )
    return (norms, k), dict(forced=forced)


def pack_chunks(
    v: torch.Tensor,
    indices: torch.Tensor,
    chunk_size: int,
    scale: float,
    wire_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> Call:
    """Gather the chosen chunks of v, scaled and cast to the wire type, into one flat buffer.

    ``packed[j*C:(j+1)*C] = cast(v[idx_j*C : idx_j*C+C] * scale)``, zero past N; the multiply is
    in float32 and the cast rounds to nearest even (overflow gives inf, NaN stays NaN). Every
    scale factor of these ops is a number or a one-element float32 tensor on the data's device
    (``_scale``).

    Returns:
        ``out`` (or a new tensor): ``len(indices) * C`` elements of ``wire_dtype``.
    """
    op = "pack_chunks"
    _flat(op, "v", v)
    _chunk(op, chunk_size)
    _wire_dtype(op, wire_dtype)
    _indices(op, indices, nchunks_of(v.numel(), chunk_size), v.device)
    out = _out(op, out, wire_dtype, indices.numel() * chunk_size, v.device)
    return (v, indices, chunk_size, _scale(op, "scale", scale, v.device), wire_dtype), dict(
        out=out)


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
) -> Call:
    """Scatter the reduced chunks into ``out``, keep what was not sent in ``residual``: one pass.

    Outside the sent chunks: ``residual[i] = v[i]`` and ``out[i] = 0``. In sent chunk j:
    ``residual[i] = v[i] - upcast(packed_local[j]) * err_scale`` (the wire rounding error; with
    ``packed_local=None`` the residual there is 0, exact for an FP32 wire) and
    ``out[i] = upcast(packed_reduced[j]) * unscale``. ``out`` may be ``v`` itself (every element
    is read before it is written); it must not partially overlap v. ``residual=None``: no error
    feedback.

    Returns:
        ``out``.
    """
    op = "unpack_update"
    _unpack(op, v, "v", residual, packed_reduced, packed_local, indices, chunk_size)
    _flat(op, "out", out, numel=v.numel(), device=v.device)
    return (v, residual, packed_reduced, packed_local, indices, chunk_size,
            _scale(op, "unscale", unscale, v.device),
            _scale(op, "err_scale", err_scale, v.device)), dict(out=out)


def unpack_sent(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    packed_reduced: torch.Tensor,
    packed_local: torch.Tensor | None,
    indices: torch.Tensor,
    chunk_size: int,
    unscale: float,
    err_scale: float,
) -> Call:
    """Write the reduced chunks into ``out`` and their rounding error into ``residual``; only those.

    The second half of ``unpack_update`` for a caller that already holds v in ``residual`` (what
    is not sent stays there as it is) and zeros in ``out`` (``chunk_norms(..., v_out=residual,
    zero_grad=True)``): only the k sent chunks are touched, not all N elements. In sent chunk j:
    ``out[i] = upcast(packed_reduced[j]) * unscale`` and ``residual[i] = residual[i] -
    upcast(packed_local[j]) * err_scale`` (0 with ``packed_local=None``, exact for an FP32 wire);
    the results are bit-identical to ``unpack_update`` on the same v. ``indices`` must be
    strictly increasing (as ``select_chunks`` returns them). ``residual=None``: out only.

    Returns:
        ``out``.
    """
    op = "unpack_sent"
    _unpack(op, out, "out", residual, packed_reduced, packed_local, indices, chunk_size)
    return (out, residual, packed_reduced, packed_local, indices, chunk_size,
            _scale(op, "unscale", unscale, out.device),
            _scale(op, "err_scale", err_scale, out.device)), {}


def masked_chunk_norms(
    v: torch.Tensor,
    chunks: torch.Tensor,
    keep: torch.Tensor,
    chunk_size: int,
    norm: str = "l1",
    *,
    out: torch.Tensor,
) -> Call:
    """Overwrite ``out[chunks[m]]`` with the norm of chunk ``chunks[m]`` over its ``keep[m]`` part.

    Why: a CSC bucket's dense parameters (biases, BN) travel on their own, so the few chunks
    that also hold some of them are ranked by their sparse elements only; one call instead of a
    gather, abs, where, sum and scatter in torch. Elements past the end of v count as zero
    whatever ``keep`` says. The norm is computed as ``chunk_norms`` computes it, over the chunk
    with the other elements zeroed (so a chunk whose ``keep`` row is all True gets the same
    bits), and agrees with the torch reference within float accumulation error.

    Args:
        v: float32, N elements. chunks: int64 chunk indices (M). keep: bool (M, chunk_size).
        out: float32, one entry per chunk of v (only ``out[chunks]`` is written).
    """
    op = "masked_chunk_norms"
    _flat(op, "v", v)
    n, dev = v.numel(), v.device
    _chunk(op, chunk_size)
    nch = nchunks_of(n, chunk_size)
    _indices(op, chunks, nch, dev)
    _norm(op, norm)
    shape = (chunks.numel(), chunk_size)
    if keep.dtype != torch.bool or tuple(keep.shape) != shape or not keep.is_contiguous():
        raise ValueError(
            f"{op}: keep must be a contiguous bool tensor of shape {shape}, "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    _flat(op, "out", out, numel=nch, device=dev)
    return (v, chunks, keep, chunk_size, norm), dict(out=out)


def dense_scatter(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    idx: torch.Tensor,
    reduced: torch.Tensor,
    local: torch.Tensor | None,
    v: torch.Tensor,
    unscale: float,
    err_scale: float,
) -> Call:
    """Write reduced dense elements into ``out`` at ``idx``, their rounding error into ``residual``.

    ``out[idx[i]] = upcast(reduced[i]) * unscale`` and, unless ``residual`` is None,
    ``residual[idx[i]] = v[i] - upcast(local[i]) * err_scale`` (v: the values that were cast
    into ``local`` and sent). Bit-identical to the torch reference. Why: the dense tail of a CSC
    bucket took six torch ops (upcast, two index_copy_, a cast, a multiply, a subtraction).

    Returns:
        ``out``.
    """
    op = "dense_scatter"
    _flat(op, "out", out)
    dev = out.device
    if (not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype != torch.int64
            or idx.device != dev):
        raise ValueError(f"{op}: idx must be a 1-D torch.int64 tensor on {dev}")
    d = idx.numel()
    _wire(op, "reduced", reduced, numel=d, device=dev)
    if residual is not None:
        _flat(op, "residual", residual, numel=out.numel(), device=dev)
        if local is None or local.dtype not in WIRE_DTYPES:
            raise ValueError(
                f"{op}: with a residual, local must be the sent wire buffer "
                f"(one of {WIRE_DTYPES})"
            )
        _flat(op, "local", local, dtype=None, numel=d, device=dev)
        _flat(op, "v", v, numel=d, device=dev)
    return (out, residual, idx, reduced, local, v, float(unscale), float(err_scale)), {}


def all_finite(x: torch.Tensor) -> Call:
    """Return whether no element of x (float32, float16 or bfloat16, 1-D) is inf or NaN.

    Why: ``bool(torch.isfinite(x).all())`` allocates a mask, which costs more than the small
    reduced tensors a compressor checks; the CPU kernel counts the all-ones exponents of the
    raw bits in one read.
    """
    _wire("all_finite", "x", x)
    return (x,), {}


def cast_scaled(
    x: torch.Tensor, scale: float, wire_dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> Call:
    """Return ``cast(x * scale)`` in ``wire_dtype`` (float32 multiply, round to nearest even)."""
    op = "cast_scaled"
    _flat(op, "x", x)
    _wire_dtype(op, wire_dtype)
    out = _out(op, out, wire_dtype, x.numel(), x.device)
    return (x, _scale(op, "scale", scale, x.device), wire_dtype), dict(out=out)


def upcast_scaled(x: torch.Tensor, scale: float, *, out: torch.Tensor) -> Call:
    """Write ``float32(x) * scale`` into ``out`` (float32); x is float32, float16 or bfloat16."""
    _wire("upcast_scaled", "x", x)
    _flat("upcast_scaled", "out", out, numel=x.numel(), device=x.device)
    return (x, _scale("upcast_scaled", "scale", scale, x.device)), dict(out=out)


def cast_feedback(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    scale: float,
    wire_dtype: torch.dtype,
    err_scale: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> Call:
    """Cast ``x + residual`` scaled to the wire type and keep its rounding error, in one pass.

    ``v = x + residual`` (``residual=None``: ``v = x``); ``out = cast(v * scale)`` rounded to
    nearest even; ``residual_out = v - float32(out) * err_scale`` (skipped when None). With
    ``scale = 1/n`` and ``err_scale = n`` this is the FP16 wire with error feedback: the three
    eager passes it replaces (add, cast, upcast-and-subtract) read the gradient three times.
    ``x`` and ``residual`` are not modified unless one is ``residual_out`` (allowed).

    Returns:
        ``out`` (or a new tensor): ``x.numel()`` elements of ``wire_dtype``.
    """
    op = "cast_feedback"
    _flat(op, "x", x)
    n, dev = x.numel(), x.device
    _wire_dtype(op, wire_dtype)
    if residual is not None:
        _flat(op, "residual", residual, numel=n, device=dev)
    if residual_out is not None:
        _flat(op, "residual_out", residual_out, numel=n, device=dev)
    out = _out(op, out, wire_dtype, n, dev)
    return (x, residual, _scale(op, "scale", scale, dev), wire_dtype,
            _scale(op, "err_scale", err_scale, dev)), dict(out=out, residual_out=residual_out)


def upcast_finite(x: torch.Tensor, scale: float, *, out: torch.Tensor) -> Call:
    """Write ``float32(x) * scale`` into ``out``; return whether all of it is finite: one pass.

    Why: a compressor decides from the reduced result whether the step overflowed (GradScaler
    then skips it); a separate ``isfinite(out).all()`` or ``out.sum()`` reads ``out`` again.
    """
    _wire("upcast_finite", "x", x)
    _flat("upcast_finite", "out", out, numel=x.numel(), device=x.device)
    return (x, _scale("upcast_finite", "scale", scale, x.device)), dict(out=out)
