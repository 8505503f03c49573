"""The CPU kernels compiled before they are needed: at install, and beside the first steps.

numba compiles a kernel at its first call, for each signature, unless its on-disk cache holds
it: with an empty cache that is about half a minute of one core for the CSC kernels, which a
first compressed step would otherwise pay inside training. Two ways keep it off that path:

- ``python -m gradientflow.kernels`` compiles every signature into numba's cache (``make
  install`` runs it; so can an image's build step). The cache is ``kernels/__pycache__`` when
  the package folder is writable, else numba's per-user cache folder, or ``NUMBA_CACHE_DIR``:
  a read-only install shared by several users points that variable at one folder warmed once.
- ``start()`` (compressors call it when they are built, on the main thread) makes the kernels
  ready beside the first steps: a cache that holds them is loaded on a daemon thread (well
  under a second); an empty one is filled first by that command in a child process, so the
  compiler takes neither this process's GIL nor its import lock (a DataLoader worker forked
  meanwhile would inherit the lock held). Until then ``ready()`` is False and the dispatch
  (``kernels.implementation``) runs the torch reference, which computes the same results
  (tests/kernels). Ranks of one host take turns through a file lock, so one compiles and the
  others load what it wrote. A fork while this process is loading waits for the load to end, and
so does the interpreter's exit: a short program that ends while the daemon thread is inside
numba's loader could otherwise be aborted by a native thread torn down under it. An exit while
the child compiles does not wait (the child goes on filling the cache).

``wait()`` blocks until the kernels are ready: for a run that must be bit-reproducible from
its first compressed step (the norms of the numba kernels and the reference may differ in
their last bits, which can change a near tie in the selection).
"""
from __future__ import annotations

import atexit
import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time

_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = threading.Event()
_loading = threading.Event()  # this process is importing or loading kernels right now
_in_child = threading.Event()  # the cache is being filled by a child process
_error: BaseException | None = None
_seconds: float | None = None


def ready() -> bool:
    """Whether every CPU kernel is compiled (or loaded from the cache) in this process."""
    return _done.is_set() and _error is None


def error() -> BaseException | None:
    """Why the warm-up failed (the dispatch then keeps the reference), or None."""
    return _error


def seconds() -> float | None:
    """How long the warm-up took in this process (None: not finished)."""
    return _seconds


def _lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"gradientflow-kernels-{os.getuid()}.lock")


def _dispatchers() -> list:
    """Every numba CPU kernel that numba caches, of the modules kernels/cpu.py launches
    (inlined helpers have no cache entry of their own)."""
    import numba

    from . import cpu, cpu_chunked, cpu_wire

    del cpu  # imported first: it sets numba's thread layer before any kernel module loads
    return [v for m in (cpu_chunked, cpu_wire) for v in vars(m).values()
            if isinstance(v, numba.core.registry.CPUDispatcher)
            and v.py_func.__module__ == m.__name__
            and v.targetoptions.get("inline") != "always"]


def cache_dir() -> str:
    """Where numba keeps the compiled CPU kernels for this install and user."""
    return str(_dispatchers()[0]._cache._cache_path)


def cached() -> bool:
    """Whether numba's cache holds an index for every CPU kernel (their signatures are then
    loaded, not compiled; a stale or missing one is compiled by the loader)."""
    try:
        names = set(os.listdir(cache_dir()))
    except OSError:
        return False
    # numba names a kernel's index "<source file's stem>.<kernel>-<line>.pyXY.nbi"
    return all(any(n.startswith(f"{d.py_func.__module__.rpartition('.')[2]}.{d.__name__}-")
                   and n.endswith(".nbi") for n in names)
               for d in _dispatchers())


def _load() -> None:
    """Compile or load every kernel signature in this process, one rank of a host at a time."""
    from . import cpu

    with open(_lock_path(), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # one rank of a host compiles; the others load
        _loading.set()
        try:
            cpu.warm_up()
        finally:
            _loading.clear()
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fill_in_child() -> None:
    """Fill the cache with `python -m gradientflow.kernels` in a child process."""
    proc = subprocess.run([sys.executable, "-m", "gradientflow.kernels"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=1800)  # a stuck compiler leaves the reference serving
    if proc.returncode != 0:
        raise RuntimeError(f"python -m gradientflow.kernels failed: {proc.stderr[-2000:]}")


def _warm(fill_first: bool) -> None:
    global _error, _seconds
    t0 = time.perf_counter()
    try:
        if fill_first:
            _in_child.set()
            try:
                _fill_in_child()
            finally:
                _in_child.clear()
        _load()
    except BaseException as exc:  # noqa: BLE001 - kept: the reference still serves
        _error = exc
    finally:
        _seconds = time.perf_counter() - t0
        _done.set()


def _at_exit() -> None:
    # Loading (or compiling) in this process: let it end before the interpreter finalizes.
    # Waiting for the child's compile instead could hold a short program for minutes.
    if _thread is not None and (_loading.is_set() or not _in_child.is_set()):
        _done.wait(120)


def _before_fork() -> None:
    # A child forked while this process imports or loads kernels would inherit held locks.
    if _loading.is_set():
        _done.wait(120)


def start() -> None:
    """Make the CPU kernels ready beside the first steps (once per process; module doc).

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
        _loading.set()  # the imports below, and cached()'s
        try:
            fill_first = not cached()  # imports kernels.cpu: starts the pool on the main thread
        finally:
            _loading.clear()
        os.register_at_fork(before=_before_fork)
        atexit.register(_at_exit)
        _thread = threading.Thread(target=_warm, args=(fill_first,), daemon=True,
                                   name="gradientflow-kernels-warm")
        _thread.start()


def wait(timeout: float | None = None) -> bool:
    """Start the warm-up if needed and block until it is done; whether the kernels are ready."""
    start()
    _done.wait(timeout)
    return ready()


def main() -> int:
    """Compile every CPU kernel into numba's cache; print where and how long it took."""
    t0 = time.perf_counter()
    try:
        _load()
    except Exception as exc:  # noqa: BLE001 - reported with its cause
        print(f"gradientflow.kernels: compiling the CPU kernels failed: {exc!r}",
              file=sys.stderr)
        return 1
    print(f"gradientflow: CPU kernels ready in {time.perf_counter() - t0:.1f} s "
          f"(numba cache: {cache_dir()})")
    return 0
