"""Compute kernels of coarse-grained sparse communication (CSC) and FP16 packing, dispatched by device.

This package is a LEAF: it imports nothing of gradientflow (it is installed as
``gradientflow.kernels`` from the top-level ``kernels/`` folder).

Every operation has three implementations with one contract:

- ``reference``: pure torch, any device, the ground truth of the tests;
- ``cpu``: numba ``@njit(parallel=True, nogil=True, cache=True)`` kernels that fuse the passes;
- ``cuda``: numba CUDA kernels (imported lazily), zero-copy on torch CUDA tensors, launched on
  torch's current stream.

``impl="auto"`` picks numba for CPU and CUDA tensors (torch when the numba CUDA target cannot
load), the torch reference otherwise; ``impl="numba"`` insists on numba; ``impl="torch"`` uses the
reference.

Conventions: gradients are 1-D contiguous float32 tensors of N elements, cut into chunks of
C = ``chunk_size`` elements, ``nchunks = ceil(N / C)``; the last chunk may be partial and counts
as zero-padded. A CSC step is::

    norms = chunk_norms(grad, residual, C, v_out=spare, zero_grad=True)
                                 # spare <- grad + residual, grad <- 0: one pass
    ... allreduce(norms) ...
    idx = select_chunks(norms, k)                   # same on every rank
    packed = pack_chunks(spare, idx, C, 1 / world, torch.float16)
    local = packed.clone()                          # kept for the rounding error
    ... allreduce(packed) ...
    if all_finite(packed):
        unpack_sent(grad, spare, packed, local, idx, C, 1.0, world)   # the k sent chunks only
        residual, spare = spare, residual           # commit

(``unpack_update`` is the one-pass alternative for a caller that keeps v in ``grad``, e.g.
without error feedback: it writes every element of ``out`` and of the residual.)

Threads (CPU kernels): the numba threading layer is TBB when ``libtbb.so.12`` can be loaded
(the ``tbb`` wheel from PyPI): fork-safe and safe with concurrent launches. Otherwise it is
``workqueue`` and every launch is serialised by a process-wide lock (workqueue aborts on
concurrent launches); numba's ``omp`` layer is never chosen by us, because a second OpenMP
runtime beside torch's kills forked children. See ``kernels/_threads.py``. The thread count is
process-wide (``set_num_threads``; ``threads_per_rank`` shares the cores between the ranks of
a host: 1 thread each for 2 ranks on 2 cores) and defaults to numba's (all cores).

numba reads its own environment variables at import: ``NUMBA_THREADING_LAYER`` (respected if
set), ``NUMBA_NUM_THREADS`` (the upper bound of ``set_num_threads``), ``NUMBA_CACHE_DIR`` (where
compiled kernels are cached when the package folder is read-only, e.g. a system install;
otherwise ``kernels/__pycache__``), ``NUMBA_ENABLE_CUDASIM`` (tests). This package reads no
environment itself. ``gradientflow.kernels.cpu.warm_up()`` compiles (or loads from the cache)
every CPU kernel up front: about 30 s the first time on this machine, 1-2 s after.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import reference
from .reference import nchunks_of

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
    "set_num_threads",
    "get_num_threads",
    "threads_per_rank",
    "threading_layer",
    "WIRE_DTYPES",
]

WIRE_DTYPES = reference.WIRE_DTYPES
_IMPLS = ("auto", "numba", "torch")
_NORMS = ("l1", "l2")

_cuda_module = None
_cuda_error: BaseException | None = None
_cuda_lock = threading.Lock()
_warned_cuda = False


# --------------------------------------------------------------------------------------------
# Threads


def set_num_threads(n: int | None) -> None:
    """Set how many threads the numba CPU kernels use (None: numba's default, all cores).

    numba's own ``set_num_threads`` is per calling thread; this setting is process-wide and is
    applied in whichever thread launches a kernel (e.g. the engine's communication thread).
    Use ``threads_per_rank`` to share the cores between ranks on one host.
    """
    from . import _threads

    _threads.set_num_threads(n)


def get_num_threads() -> int:
    """Return the number of threads the numba CPU kernels will use."""
    from . import _threads

    return _threads.get_num_threads()


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Return the threads each of ``local_world_size`` ranks on one host should use (at least 1).

    Ranks that share the cores each get ``cores // local_world_size``; with 2 cores and 2 ranks
    that is 1, which avoids oversubscription (the kernels are memory bound anyway).
    """
    import os

    if local_world_size < 1:
        raise ValueError(
            f"threads_per_rank: local_world_size must be >= 1, got {local_world_size}"
        )
    cores = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def threading_layer() -> str:
    """Return the numba threading layer the CPU kernels run on (starts numba's pool if needed)."""
    from . import _threads

    return _threads.threading_layer()


# --------------------------------------------------------------------------------------------
# Dispatch


def _cuda():
    """Import the numba CUDA kernels once; remember why when they cannot load."""
    global _cuda_module, _cuda_error
    if _cuda_module is None and _cuda_error is None:
        with _cuda_lock:
            if _cuda_module is None and _cuda_error is None:
                try:
                    from . import cuda as mod

                    mod.check_available()
                    _cuda_module = mod
                except Exception as exc:  # noqa: BLE001 - any failure means "no numba CUDA"
                    _cuda_error = exc
    return _cuda_module


def _backend(op: str, impl: str, device: torch.device):
    """Return the module implementing ``op`` for ``device`` under ``impl``."""
    global _warned_cuda
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch":
        return reference
    if device.type == "cpu":
        from . import cpu

        return cpu
    if device.type == "cuda":
        mod = _cuda()
        if mod is not None:
            return mod
        if impl == "numba":
            raise RuntimeError(
                f"{op}: impl='numba' was asked for a CUDA tensor but numba's CUDA target cannot "
                f"load ({_cuda_error}); install the 'gpu' extra (numba-cuda) or pass impl='auto'"
            )
        if not _warned_cuda:
            _warned_cuda = True
            warnings.warn(
                f"gradientflow.kernels: numba CUDA kernels unavailable ({_cuda_error}); "
                "using the torch reference on CUDA tensors",
                RuntimeWarning,
                stacklevel=3,
            )
        return reference
    if impl == "numba":
        raise ValueError(
            f"{op}: impl='numba' supports CPU and CUDA tensors, got a {device.type} tensor; "
            "pass impl='auto' or impl='torch'"
        )
    return reference


def _check_flat(op: str, name: str, t: torch.Tensor, dtype=torch.float32, numel: int | None = None, device=None) -> None:
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


def _check_upcast(op: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """Refuse a wire buffer x of another dtype, or an out that is not float32 of x's size."""
    _check_flat(op, "x", x, dtype=None)
    if x.dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: x must be one of {WIRE_DTYPES}, got {x.dtype}")
    _check_flat(op, "out", out, numel=x.numel(), device=x.device)


def _check_chunk(op: str, chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be an int >= 1, got {chunk_size!r}")


def _check_indices(op: str, indices: torch.Tensor, nch: int, device) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(
            f"{op}: indices must be a 1-D torch.int64 tensor (as select_chunks returns), "
            f"got {getattr(indices, 'dtype', type(indices))}"
        )
    if indices.device != device:
        raise ValueError(f"{op}: indices are on {indices.device} but the gradient is on {device}")
    if indices.numel() > nch:
        raise ValueError(f"{op}: {indices.numel()} indices for only {nch} chunks")


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
    impl: str = "auto",
) -> torch.Tensor:
    """Fold the residual (and DGC momentum) into ``grad`` (or ``v_out``) and return each chunk's norm.

    One read of the gradient. Without momentum: ``v = grad + residual``. With momentum
    correction (``momentum`` given): ``u = m * momentum + grad`` and ``v = residual + u``; with
    ``nesterov``: ``u = (momentum + grad) * m`` and ``v = residual + u + grad``. ``u`` is written
    into ``momentum_out`` (which may be ``momentum`` itself). ``v`` is written into ``grad``, or
    into ``v_out`` when given; ``residual`` is never modified, so a caller can undo a non-finite
    step. With ``zero_grad`` (only beside a ``v_out``) ``grad`` is zeroed in the same pass: a
    compressor that keeps v in its spare residual buffer then only writes the sent chunks into
    ``grad`` afterwards (``unpack_sent``), instead of a second full pass (``unpack_update``).

    Args:
        grad: float32 gradient, N elements; overwritten with v.
        residual: float32, N elements, or None (no error feedback: v = grad).
        chunk_size: C >= 1.
        norm: "l1" (sum of |v|) or "l2" (sum of v*v: the SQUARED L2 norm; same ranking).
        momentum, momentum_out: float32, N elements, both or neither.
        m: momentum factor. nesterov: Nesterov variant.
        v_out: float32, N elements, or None (v goes into grad); a buffer of its own (not grad,
            residual, momentum or momentum_out).
        zero_grad: set grad to zeros (needs v_out).
        impl: "auto" | "numba" | "torch".

    Returns:
        float32 tensor of ``nchunks`` norms on grad's device (NaN/inf where v is non-finite).
    """
    op = "chunk_norms"
    _check_flat(op, "grad", grad)
    n, dev = grad.numel(), grad.device
    _check_chunk(op, chunk_size)
    if norm not in _NORMS:
        raise ValueError(f"{op}: norm must be one of {_NORMS}, got {norm!r}")
    if residual is not None:
        _check_flat(op, "residual", residual, numel=n, device=dev)
    if (momentum is None) != (momentum_out is None):
        raise ValueError(f"{op}: pass both momentum and momentum_out, or neither")
    if momentum is not None:
        _check_flat(op, "momentum", momentum, numel=n, device=dev)
        _check_flat(op, "momentum_out", momentum_out, numel=n, device=dev)
    if v_out is not None:
        _check_flat(op, "v_out", v_out, numel=n, device=dev)
        if n and any(t is not None and t.data_ptr() == v_out.data_ptr()
                     for t in (grad, residual, momentum, momentum_out)):
            raise ValueError(
                f"{op}: v_out must be a buffer of its own, not grad, residual or momentum "
                "(the kernels read those while v is written); pass v_out=None to write v into grad"
            )
    elif zero_grad:
        raise ValueError(f"{op}: zero_grad=True needs a v_out (v would be lost with grad); pass both")
    mod = _backend(op, impl, dev)
    kw = dict(v_out=v_out, zero_grad=bool(zero_grad)) if v_out is not None else {}
    return mod.chunk_norms(
        grad, residual, chunk_size, norm,
        momentum=momentum, momentum_out=momentum_out, m=float(m), nesterov=bool(nesterov), **kw,
    )


def select_chunks(
    norms: torch.Tensor, k: int, *, forced: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """Return the top-k chunks by norm, ties to the lower index, sorted ascending (int64).

    NaN norms rank as +inf, so a non-finite chunk is always chosen, the same on every rank.
    ``forced`` (bool, one per chunk) marks chunks that are always included and do not count in
    k; k is then capped at the number of chunks not forced.
    """
    op = "select_chunks"
    _check_flat(op, "norms", norms, dtype=None)
    if not norms.is_floating_point():
        raise ValueError(f"{op}: norms must be a floating tensor, got {norms.dtype}")
    nch = norms.numel()
    if not isinstance(k, int) or not 0 <= k <= nch:
        raise ValueError(f"{op}: k must be an int in [0, {nch}] (the number of chunks), got {k!r}")
    if forced is not None:
        if forced.dtype != torch.bool or forced.numel() != nch:
            raise ValueError(
                f"{op}: forced must be a bool tensor with one entry per chunk ({nch}), "
                f"got {forced.dtype} with {forced.numel()}"
            )
    mod = _backend(op, impl, norms.device)
    # The CPU kernel selects in O(n) without a sort (0.5-0.7 ms -> tens of us per ResNet-50
    # bucket); forced chunks and GPUs take the torch reference.
    if forced is not None or not hasattr(mod, "select_chunks") or mod is reference:
        return reference.select_chunks(norms, k, forced=forced)
    return mod.select_chunks(norms, k)


def pack_chunks(
    v: torch.Tensor,
    indices: torch.Tensor,
    chunk_size: int,
    scale: float,
    wire_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Gather the chosen chunks of v, scaled and cast to the wire type, into one flat buffer.

    ``packed[j*C:(j+1)*C] = cast(v[idx_j*C : idx_j*C+C] * scale)``, zero past N; the multiply is
    in float32 and the cast rounds to nearest even (overflow gives inf, NaN stays NaN).

    Returns:
        ``out`` (or a new tensor): ``len(indices) * C`` elements of ``wire_dtype``.
    """
    op = "pack_chunks"
    _check_flat(op, "v", v)
    _check_chunk(op, chunk_size)
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
    _check_indices(op, indices, nchunks_of(v.numel(), chunk_size), v.device)
    k = indices.numel()
    if out is None:
        out = torch.empty(k * chunk_size, dtype=wire_dtype, device=v.device)
    else:
        _check_flat(op, "out", out, dtype=wire_dtype, numel=k * chunk_size, device=v.device)
    mod = _backend(op, impl, v.device)
    return mod.pack_chunks(v, indices, chunk_size, float(scale), wire_dtype, out=out)


def _check_unpack_inputs(op: str, target: torch.Tensor, name: str, residual: torch.Tensor | None,
                         packed_reduced: torch.Tensor, packed_local: torch.Tensor | None,
                         indices: torch.Tensor, chunk_size: int) -> None:
    """An unpack's inputs: the flat target, the chunk indices, the packed chunks (wire dtypes,
    k * chunk_size elements) and the residual."""
    _check_flat(op, name, target)
    dev, n = target.device, target.numel()
    _check_chunk(op, chunk_size)
    _check_indices(op, indices, nchunks_of(n, chunk_size), dev)
    packed_numel = indices.numel() * chunk_size
    for label, packed in (("packed_reduced", packed_reduced), ("packed_local", packed_local)):
        if packed is None:
            continue
        if packed.dtype not in WIRE_DTYPES:
            raise ValueError(f"{op}: {label} must be one of {WIRE_DTYPES}, got {packed.dtype}")
        _check_flat(op, label, packed, dtype=None, numel=packed_numel, device=dev)
    if residual is not None:
        _check_flat(op, "residual", residual, numel=n, device=dev)
        if residual.data_ptr() == target.data_ptr() and n:
            raise ValueError(f"{op}: residual must not be {name} itself")


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
    impl: str = "auto",
) -> torch.Tensor:
    """Scatter the reduced chunks into ``out`` and keep what was not sent in ``residual``, in one pass.

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
    _check_unpack_inputs(op, v, "v", residual, packed_reduced, packed_local, indices, chunk_size)
    _check_flat(op, "out", out, numel=v.numel(), device=v.device)
    mod = _backend(op, impl, v.device)
    return mod.unpack_update(
        v, residual, packed_reduced, packed_local, indices, chunk_size,
        float(unscale), float(err_scale), out=out,
    )


def unpack_sent(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    packed_reduced: torch.Tensor,
    packed_local: torch.Tensor | None,
    indices: torch.Tensor,
    chunk_size: int,
    unscale: float,
    err_scale: float,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Write the reduced chunks into ``out`` and their rounding error into ``residual``; nothing else.

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
    _check_unpack_inputs(op, out, "out", residual, packed_reduced, packed_local, indices,
                         chunk_size)
    mod = _backend(op, impl, out.device)
    if not hasattr(mod, "unpack_sent"):
        mod = reference
    return mod.unpack_sent(out, residual, packed_reduced, packed_local, indices, chunk_size,
                           float(unscale), float(err_scale))


def masked_chunk_norms(
    v: torch.Tensor,
    chunks: torch.Tensor,
    keep: torch.Tensor,
    chunk_size: int,
    norm: str = "l1",
    *,
    out: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """Overwrite ``out[chunks[m]]`` with the norm of chunk ``chunks[m]`` of v over the elements ``keep[m]`` marks.

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
    _check_flat(op, "v", v)
    n, dev = v.numel(), v.device
    _check_chunk(op, chunk_size)
    nch = nchunks_of(n, chunk_size)
    _check_indices(op, chunks, nch, dev)
    if norm not in _NORMS:
        raise ValueError(f"{op}: norm must be one of {_NORMS}, got {norm!r}")
    if keep.dtype != torch.bool or tuple(keep.shape) != (chunks.numel(), chunk_size) or not keep.is_contiguous():
        raise ValueError(
            f"{op}: keep must be a contiguous bool tensor of shape ({chunks.numel()}, {chunk_size}), "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    _check_flat(op, "out", out, numel=nch, device=dev)
    mod = _backend(op, impl, dev)
    if not hasattr(mod, "masked_chunk_norms"):
        mod = reference
    return mod.masked_chunk_norms(v, chunks, keep, chunk_size, norm, out=out)


def dense_scatter(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    idx: torch.Tensor,
    reduced: torch.Tensor,
    local: torch.Tensor | None,
    v: torch.Tensor,
    unscale: float,
    err_scale: float,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Write reduced dense elements to their positions in ``out`` and their rounding error into ``residual``.

    ``out[idx[i]] = upcast(reduced[i]) * unscale`` and, unless ``residual`` is None,
    ``residual[idx[i]] = v[i] - upcast(local[i]) * err_scale`` (v: the values that were cast
    into ``local`` and sent). Bit-identical to the torch reference. Why: the dense tail of a CSC
    bucket took six torch ops (upcast, two index_copy_, a cast, a multiply, a subtraction).

    Returns:
        ``out``.
    """
    op = "dense_scatter"
    _check_flat(op, "out", out)
    dev = out.device
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype != torch.int64 or idx.device != dev:
        raise ValueError(f"{op}: idx must be a 1-D torch.int64 tensor on {dev}")
    d = idx.numel()
    if reduced.dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: reduced must be one of {WIRE_DTYPES}, got {reduced.dtype}")
    _check_flat(op, "reduced", reduced, dtype=None, numel=d, device=dev)
    if residual is not None:
        _check_flat(op, "residual", residual, numel=out.numel(), device=dev)
        if local is None or local.dtype not in WIRE_DTYPES:
            raise ValueError(f"{op}: with a residual, local must be the sent wire buffer (one of {WIRE_DTYPES})")
        _check_flat(op, "local", local, dtype=None, numel=d, device=dev)
        _check_flat(op, "v", v, numel=d, device=dev)
    mod = _backend(op, impl, dev)
    if not hasattr(mod, "dense_scatter"):
        mod = reference
    return mod.dense_scatter(out, residual, idx, reduced, local, v, float(unscale), float(err_scale))


def all_finite(x: torch.Tensor, *, impl: str = "auto") -> bool:
    """Return whether no element of x (float32, float16 or bfloat16, 1-D) is inf or NaN.

    Why: ``bool(torch.isfinite(x).all())`` allocates a mask and costs 40-120 us per call on the
    small reduced tensors a compressor checks 2-3 times per bucket; the CPU kernel counts the
    all-ones exponents of the raw bits in one read.
    """
    op = "all_finite"
    _check_flat(op, "x", x, dtype=None)
    if x.dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: x must be one of {WIRE_DTYPES}, got {x.dtype}")
    mod = _backend(op, impl, x.device)
    if not hasattr(mod, "all_finite"):
        mod = reference
    return bool(mod.all_finite(x))


def cast_scaled(
    x: torch.Tensor,
    scale: float,
    wire_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Return ``cast(x * scale)`` in ``wire_dtype`` (float32 multiply, round to nearest even)."""
    op = "cast_scaled"
    _check_flat(op, "x", x)
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
    if out is None:
        out = torch.empty(x.numel(), dtype=wire_dtype, device=x.device)
    else:
        _check_flat(op, "out", out, dtype=wire_dtype, numel=x.numel(), device=x.device)
    mod = _backend(op, impl, x.device)
    return mod.cast_scaled(x, float(scale), wire_dtype, out=out)


def upcast_scaled(
    x: torch.Tensor, scale: float, *, out: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """Write ``float32(x) * scale`` into ``out`` (float32); x is float32, float16 or bfloat16."""
    op = "upcast_scaled"
    _check_upcast(op, x, out)
    mod = _backend(op, impl, x.device)
    return mod.upcast_scaled(x, float(scale), out=out)


def cast_feedback(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    scale: float,
    wire_dtype: torch.dtype,
    err_scale: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
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
    _check_flat(op, "x", x)
    n, dev = x.numel(), x.device
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{op}: wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
    if residual is not None:
        _check_flat(op, "residual", residual, numel=n, device=dev)
    if residual_out is not None:
        _check_flat(op, "residual_out", residual_out, numel=n, device=dev)
    if out is None:
        out = torch.empty(n, dtype=wire_dtype, device=dev)
    else:
        _check_flat(op, "out", out, dtype=wire_dtype, numel=n, device=dev)
    mod = _backend(op, impl, dev)
    if not hasattr(mod, "cast_feedback"):  # the CUDA kernels have no fused version: torch on the GPU
        mod = reference
    return mod.cast_feedback(x, residual, float(scale), wire_dtype, float(err_scale), out=out,
                             residual_out=residual_out)


def upcast_finite(x: torch.Tensor, scale: float, *, out: torch.Tensor, impl: str = "auto") -> bool:
    """Write ``float32(x) * scale`` into ``out`` and return whether all of it is finite, in one pass.

    Why: a compressor decides from the reduced result whether the step overflowed (GradScaler
    then skips it); a separate ``isfinite(out).all()`` or ``out.sum()`` reads ``out`` again.
    """
    op = "upcast_finite"
    _check_upcast(op, x, out)
    mod = _backend(op, impl, x.device)
    if not hasattr(mod, "upcast_finite"):  # the CUDA kernels have no fused version: torch on the GPU
        mod = reference
    return bool(mod.upcast_finite(x, float(scale), out=out))
