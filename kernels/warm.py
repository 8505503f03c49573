"""The CPU kernels compiled before they are needed: at install, and in the background.

numba compiles a kernel at its first call, for each signature, unless its on-disk cache holds
it: with an empty cache that is about half a minute of one core for the CSC kernels, which a
first compressed step would otherwise pay inside training. Two ways keep it off that path:

- ``python -m gradientflow.kernels.warm`` compiles every signature into numba's cache (``make
  install`` runs it; so can an image's build step). The cache is ``kernels/__pycache__`` when
  the package folder is writable, else numba's per-user cache folder, or ``NUMBA_CACHE_DIR``:
  a read-only install shared by several users points that variable at one folder warmed once.
- ``start()`` (compressors call it when they are built, on the main thread) loads or compiles
  them on a daemon thread; until that thread is done, ``ready()`` is False and the dispatch
  (``kernels.implementation``) runs the torch reference, which computes the same results
  (tests/kernels). Ranks of one host take turns through a file lock, so one compiles and the
  others then load what it wrote.

``wait()`` blocks until the kernels are ready: for a run that must be bit-reproducible from
its first compressed step (the norms of the numba kernels and the reference may differ in
their last bits, which can change a near tie in the selection).
"""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import threading
import time

_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = threading.Event()
_error: BaseException | None = None
_seconds: float | None = None


def ready() -> bool:
    """Whether every CPU kernel is compiled (or loaded from the cache) in this process."""
    return _done.is_set() and _error is None


def error() -> BaseException | None:
    """Why the background warm-up failed (the dispatch then keeps the reference), or None."""
    return _error


def seconds() -> float | None:
    """How long the warm-up took in this process (None: not finished)."""
    return _seconds


def _lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"gradientflow-kernels-{os.getuid()}.lock")


def _warm() -> None:
    global _error, _seconds
    t0 = time.perf_counter()
    try:
        from . import cpu

        with open(_lock_path(), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # one rank of a host compiles; the others load
            try:
                cpu.warm_up()
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    except BaseException as exc:  # noqa: BLE001 - kept: the reference still serves
        _error = exc
    finally:
        _seconds = time.perf_counter() - t0
        _done.set()


def start() -> None:
    """Start loading or compiling the CPU kernels on a daemon thread (once per process).

    On the main thread, numba's thread pool is started here first (kernels/_threads.py: a
    TBB pool must be started by the main thread); elsewhere the pool starts wherever the
    first kernel runs, as before.
    """
    global _thread
    if _thread is not None or _done.is_set():
        return
    with _lock:
        if _thread is not None or _done.is_set():
            return
        from . import cpu  # noqa: F401 - imported here: starts the pool on the main thread

        _thread = threading.Thread(target=_warm, name="gradientflow-kernels-warm", daemon=True)
        _thread.start()


def wait(timeout: float | None = None) -> bool:
    """Start the warm-up if needed and block until it is done; whether the kernels are ready."""
    start()
    _done.wait(timeout)
    return ready()


def cache_dir() -> str:
    """Where numba keeps the compiled CPU kernels for this install and user."""
    import numba

    from . import cpu

    for v in vars(cpu).values():
        if isinstance(v, numba.core.registry.CPUDispatcher):
            return str(v._cache._cache_path)
    return "?"


def main() -> int:
    """Compile every CPU kernel into numba's cache; print where and how long it took."""
    t0 = time.perf_counter()
    _warm()
    if _error is not None:
        print(f"gradientflow.kernels.warm: failed: {_error!r}", file=sys.stderr)
        return 1
    print(f"gradientflow: CPU kernels ready in {time.perf_counter() - t0:.1f} s "
          f"(numba cache: {cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
