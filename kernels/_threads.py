"""Choose a numba threading layer that is safe beside torch, and share the thread count.

Why: on a host where torch uses GNU OpenMP, numba's default choice (``omp`` when it loads) puts
a second OpenMP runtime in the process, after which a forked child dies; numba's ``workqueue``
layer aborts when two threads launch parallel kernels at once. TBB is both fork-safe and
thread-safe, so it is preferred: the ``tbb`` wheel from PyPI (``pip install tbb``) installs
``libtbb.so.12`` under ``<prefix>/lib``, which numba's ``tbbpool`` extension cannot find on its
own (no rpath there), so it is loaded here by absolute path before numba starts its pool.

Policy, decided once before the first parallel launch:

- ``NUMBA_THREADING_LAYER`` set by the user (numba reads it into ``numba.config``): respected.
- otherwise, if libtbb loads and the pool is started by the main thread: ``tbb``;
- otherwise ``workqueue``, and every kernel launch is serialised by a process-wide lock, so
  two threads can never be inside the pool at once (the kernels release the GIL, the lock
  keeps workqueue safe; TBB and OpenMP need no lock).

numba's TBB pool belongs to the thread that starts it. Started by another thread (an engine
thread launches most kernels) and that thread idle or gone, the interpreter's exit waits for it
forever or aborts ("terminate called without an active exception"; numba issue 10556, seen here
with one core). So importing ``kernels.cpu`` or building a compressor on the main thread starts
the pool there (``start_on_main_thread``, about 0.1 s); a pool first needed on another thread is
``workqueue``.

The thread count is process-wide here (numba's own ``set_num_threads`` is per calling thread)
and applied in whichever thread launches a kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

import numba

_lock = threading.Lock()
_configured = False
_layer: str | None = None  # known after the first launch
_serialise = True  # until the layer is known, assume the unsafe one
_num_threads: int | None = None
_tbb_by_default = False  # configure() chose TBB (the user did not choose a layer)


def _load_tbb() -> bool:
    """Load libtbb.so.12 with global symbols if the tbb wheel (or a system TBB) provides it."""
    candidates = []
    try:
        from importlib import metadata

        for f in metadata.distribution("tbb").files or ():
            if str(f).endswith("libtbb.so.12"):
                candidates.append(str(f.locate()))
    except Exception:  # noqa: BLE001 - the wheel is optional
        pass
    candidates += [os.path.join(sys.prefix, "lib", "libtbb.so.12"), "libtbb.so.12"]
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


def configure() -> None:
    """Pick the threading layer (once, before numba starts its pool)."""
    global _configured, _tbb_by_default
    if _configured:
        return
    with _lock:
        if _configured:
            return
        chosen = str(numba.config.THREADING_LAYER).lower()
        if chosen == "default":
            _tbb_by_default = _load_tbb()
            numba.config.THREADING_LAYER = "tbb" if _tbb_by_default else "workqueue"
        elif chosen in ("tbb", "safe", "threadsafe"):
            _load_tbb()
        _configured = True


def set_num_threads(n: int | None) -> None:
    """Set the process-wide thread count of the kernels (None: numba's default)."""
    global _num_threads
    if n is not None:
        limit = numba.config.NUMBA_NUM_THREADS
        if not isinstance(n, int) or not 1 <= n <= limit:
            raise ValueError(
                f"set_num_threads: n must be an int in [1, {limit}] (NUMBA_NUM_THREADS), got {n!r}"
            )
    _num_threads = n


def get_num_threads() -> int:
    """Return the thread count the kernels will use."""
    return _num_threads if _num_threads is not None else numba.config.NUMBA_NUM_THREADS


def _start() -> None:
    """Start numba's pool on the chosen layer and learn whether launches must be serialised."""
    global _layer, _serialise
    configure()
    with _lock:
        if _layer is None:
            if _tbb_by_default and threading.current_thread() is not threading.main_thread():
                numba.config.THREADING_LAYER = "workqueue"  # see the module docstring
            numba.get_num_threads()  # starts the pool on the configured layer
            _serialise = numba.threading_layer() == "workqueue"
            _layer = numba.threading_layer()


def start_on_main_thread() -> None:
    """Start numba's pool now if this is the main thread (a TBB pool must start there)."""
    if _layer is None and threading.current_thread() is threading.main_thread():
        _start()


@contextlib.contextmanager
def launch():
    """Context for one kernel launch: this thread's numba thread count set, the lock if needed."""
    if _layer is None:
        _start()
    want = get_num_threads()
    if _serialise:
        with _lock:
            if numba.get_num_threads() != want:
                numba.set_num_threads(want)
            yield
    else:
        if numba.get_num_threads() != want:
            numba.set_num_threads(want)
        yield


def threading_layer() -> str:
    """Return the threading layer in use (starting numba's pool if it has not started)."""
    if _layer is None:
        _start()
    return _layer
