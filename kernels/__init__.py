"""Compute kernels of coarse-grained sparse communication (CSC) and FP16 packing, by device.

This package is a LEAF: it imports nothing of gradientflow (it is installed as
``gradientflow.kernels`` from the top-level ``kernels/`` folder).

``OPS`` is the table of the 12 operations, ``{op: Op(validate, reference, cpu, cuda)}``:

- ``validate`` (``checks.py``): the public signature and docstring, the argument checks;
- ``reference`` (``reference.py``): pure torch, any device, the ground truth of the tests;
- ``cpu`` (``cpu.py``): numba ``@njit(parallel=True, nogil=True, cache=True)`` kernels that
  fuse the passes (every op has one; the kernels themselves in ``cpu_chunked.py`` and
  ``cpu_wire.py``);
- ``cuda`` (``cuda.py``, imported lazily): numba CUDA kernels, zero-copy on torch CUDA tensors,
  launched on torch's current stream (five ops; the others run the reference on the GPU);
- ``triton`` (``triton_kernels.py``, imported lazily): Triton kernels for CUDA tensors, one
  fused launch per CSC pass, selection on the device without a sort (seven ops), preferred
  over numba's where Triton loads (that module's docstring says why).

``StepGraphs`` (``graphs.py``) runs a step of these ops as one CUDA graph per layout (captured
on the second call, replayed after; eager where capture is not possible): a CSC step on a GPU
is bound by the host's launches, and a replay is one.

Each public function (``chunk_norms``, ...) is the op's validator followed by ``implementation``,
the one dispatcher.

``impl="auto"`` picks numba for CPU tensors once they are compiled (``warm.py``: at install,
or on a background thread from the first compressor on; the reference until then); for CUDA
tensors Triton, else numba, else the torch reference (whichever first loads and has the op);
the reference for other devices.
``impl="numba"`` and ``impl="triton"`` insist on that one (the reference for an op it lacks);
``impl="torch"`` uses the reference.

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
(the ``tbb`` wheel from PyPI) and the main thread starts the pool (importing ``kernels.cpu`` or
building a compressor there does): fork-safe and safe with concurrent launches. Otherwise it is
``workqueue`` and every launch is serialised by a process-wide lock (workqueue aborts on
concurrent launches); numba's ``omp`` layer is never chosen by us, because a second OpenMP
runtime beside torch's kills forked children. See ``kernels/_threads.py``. The thread count is
process-wide (``set_num_threads``; ``threads_per_rank`` shares the cores between the ranks of
a host: 1 thread each for 2 ranks on 2 cores) and defaults to numba's (all cores).

numba reads its own environment variables at import: ``NUMBA_THREADING_LAYER`` (respected if
set), ``NUMBA_NUM_THREADS`` (the upper bound of ``set_num_threads``), ``NUMBA_CACHE_DIR`` (where
compiled kernels are cached when the package folder is read-only, e.g. a system install;
otherwise ``kernels/__pycache__``), ``NUMBA_ENABLE_CUDASIM`` (tests). This package reads no
environment itself. ``python -m gradientflow.kernels`` (``make install`` runs it) compiles
every CPU kernel into the cache; ``warm.start()`` / ``warm.wait()`` load or compile them in the
background / before returning.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import checks, reference, warm
from .graphs import StepGraphs
from .reference import WIRE_DTYPES, nchunks_of

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
    "start_threads",
    "threads_per_rank",
    "threading_layer",
    "WIRE_DTYPES",
    "OPS",
    "StepGraphs",
]


class Op(NamedTuple):
    """One operation: who checks its arguments and who implements it on each device."""

    validate: Callable[..., checks.Call]  # the public signature; returns the implementations' call
    reference: Callable  # pure torch, any device: the ground truth
    cpu: bool  # kernels.cpu has a numba kernel of this name
    cuda: bool  # kernels.cuda (numba) has one; without it CUDA tensors take the reference
    triton: bool  # kernels.triton_kernels has one


def _op(name: str, cpu: bool = True, cuda: bool = False, triton: bool = False) -> Op:
    return Op(getattr(checks, name), getattr(reference, name), cpu, cuda, triton)


OPS: dict[str, Op] = {
    "chunk_norms": _op("chunk_norms", cuda=True, triton=True),
    "select_chunks": _op("select_chunks", triton=True),
    "pack_chunks": _op("pack_chunks", cuda=True, triton=True),
    "unpack_update": _op("unpack_update", cuda=True, triton=True),
    "unpack_sent": _op("unpack_sent", triton=True),
    "masked_chunk_norms": _op("masked_chunk_norms"),
    "dense_scatter": _op("dense_scatter"),
    "all_finite": _op("all_finite"),
    "cast_scaled": _op("cast_scaled", cuda=True, triton=True),
    "upcast_scaled": _op("upcast_scaled", cuda=True, triton=True),
    "cast_feedback": _op("cast_feedback"),
    "upcast_finite": _op("upcast_finite"),
}

_IMPLS = ("auto", "numba", "triton", "torch")

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


def start_threads() -> None:
    """Start the CPU kernels' thread pool, and their warm-up, now if this is the main thread.

    Compressors call it when they are built (on the user's thread): numba's TBB pool must be
    started by the main thread, and a pool first needed on another thread is not TBB
    (``kernels/_threads.py``); the kernels then load or compile in the background
    (``warm.py``) while the first, dense steps run.
    """
    from . import _threads

    _threads.start_on_main_thread()
    if threading.current_thread() is threading.main_thread():
        warm.start()


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Return the threads each of ``local_world_size`` ranks on one host should use (at least 1).

    Ranks that share the cores each get ``cores // local_world_size``; with 2 cores and 2 ranks
    that is 1, which avoids oversubscription (the kernels are memory bound anyway).
    """
    if local_world_size < 1:
        raise ValueError(
            f"threads_per_rank: local_world_size must be >= 1, got {local_world_size}"
        )
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // local_world_size)


def threading_layer() -> str:
    """Return the numba threading layer the CPU kernels run on (starts numba's pool if needed)."""
    from . import _threads

    return _threads.threading_layer()


# --------------------------------------------------------------------------------------------
# Dispatch


class _Lazy:
    """A kernel module imported on first use, with its availability probe run once; the error
    is kept when it cannot load (the dispatch then falls back and says why)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = None
        self.error: BaseException | None = None

    def get(self):
        if self.module is None and self.error is None:
            with _cuda_lock:
                if self.module is None and self.error is None:
                    try:
                        mod = importlib.import_module(f".{self.name}", __name__)
                        mod.check_available()
                        self.module = mod
                    except Exception as exc:  # noqa: BLE001 - any failure means "cannot load"
                        self.error = exc
        return self.module


_NUMBA_CUDA = _Lazy("cuda")
_TRITON = _Lazy("triton_kernels")


def _cuda():
    """The numba CUDA kernels, or None when they cannot load (``cuda_error()`` says why)."""
    return _NUMBA_CUDA.get()


def _triton():
    """The Triton kernels, or None when they cannot load (``triton_error()`` says why)."""
    return _TRITON.get()


def cuda_error() -> BaseException | None:
    """Why the numba CUDA kernels cannot load (None if they can, or were not tried)."""
    return _NUMBA_CUDA.error


def triton_error() -> BaseException | None:
    """Why the Triton kernels cannot load (None if they can, or were not tried)."""
    return _TRITON.error


def _device_module(op: str, impl: str, device: torch.device):
    """Return the module that runs ``impl`` on ``device``: numba's cpu or cuda, or the reference."""
    global _warned_cuda
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch":
        return reference
    if device.type == "cpu":
        if impl == "auto" and not warm.ready():
            warm.start()  # compiled off the training path; the reference serves meanwhile
            return reference
        from . import cpu

        return cpu
    if device.type == "cuda":
        mod = _cuda()
        if mod is not None:
            return mod
        if impl == "numba":
            raise RuntimeError(
                f"{op}: impl='numba' was asked for a CUDA tensor but numba's CUDA target cannot "
                f"load ({_NUMBA_CUDA.error}); install the 'gpu' extra (numba-cuda) or pass "
                "impl='auto'"
            )
        if not _warned_cuda:
            _warned_cuda = True
            warnings.warn(
                f"gradientflow.kernels: numba CUDA kernels unavailable ({_NUMBA_CUDA.error}); "
                "using the torch reference on CUDA tensors",
                RuntimeWarning,
                stacklevel=4,
            )
        return reference
    if impl == "numba":
        raise ValueError(
            f"{op}: impl='numba' supports CPU and CUDA tensors, got a {device.type} tensor; "
            "pass impl='auto' or impl='torch'"
        )
    return reference


def implementation(op: str, impl: str, device: torch.device) -> Callable:
    """Return the function that runs ``op`` under ``impl`` on ``device`` (the one dispatcher).

    A module without a kernel for ``op`` (``OPS``) leaves it to the torch reference: e.g.
    ``all_finite`` on CUDA, ``unpack_sent`` under ``impl="numba"`` on CUDA.
    """
    spec = OPS[op]
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "triton":
        if device.type != "cuda":
            raise ValueError(f"{op}: impl='triton' supports CUDA tensors, got a {device.type} "
                             "tensor; pass impl='auto' or impl='torch'")
        mod = _triton()
        if mod is None:
            raise RuntimeError(f"{op}: impl='triton' was asked for but Triton's kernels cannot "
                               f"run here ({_TRITON.error}); pass impl='auto'")
        return getattr(mod, op) if spec.triton else spec.reference
    if device.type == "cuda" and impl == "auto":
        if spec.triton and _triton() is not None:
            return getattr(_TRITON.module, op)
        if not spec.cuda:
            return spec.reference
    mod = _device_module(op, impl, device)
    if mod is reference or not getattr(spec, device.type):
        return spec.reference
    return getattr(mod, op)


_IMPL_PARAM = inspect.Parameter("impl", inspect.Parameter.KEYWORD_ONLY, default="auto",
                                annotation="str")


def _public(op: str):
    """The public function of ``op``: its contract's signature and docstring, plus ``impl``."""
    validate = OPS[op].validate

    @functools.wraps(validate)
    def run(*args, impl: str = "auto", **kwargs):
        call_args, call_kwargs = validate(*args, **kwargs)
        return implementation(op, impl, call_args[0].device)(*call_args, **call_kwargs)

    run.__module__ = __name__
    sig = inspect.signature(validate)
    run.__signature__ = sig.replace(
        parameters=[*sig.parameters.values(), _IMPL_PARAM],
        return_annotation=inspect.Signature.empty,
    )
    return run


chunk_norms = _public("chunk_norms")
select_chunks = _public("select_chunks")
pack_chunks = _public("pack_chunks")
unpack_update = _public("unpack_update")
unpack_sent = _public("unpack_sent")
masked_chunk_norms = _public("masked_chunk_norms")
dense_scatter = _public("dense_scatter")
all_finite = _public("all_finite")
cast_scaled = _public("cast_scaled")
upcast_scaled = _public("upcast_scaled")
cast_feedback = _public("cast_feedback")
upcast_finite = _public("upcast_finite")
