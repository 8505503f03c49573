"""Completion of Works' futures off the thread that drives the transport.

`Future.set_result` runs `.then` callbacks on the calling thread, and PyTorch's powerSGD_hook
waits on another collective's future inside its callbacks. Completing on the engine thread, or
on one single completion thread, would deadlock it; a pool that grows when every thread is
busy does not: one blocked callback never stops other completions.
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

import torch

# Big enough that blocked callbacks (each waiting on a later collective) cannot starve the
# pool in any realistic program; threads are only created when none is idle.
_MAX_THREADS = 512
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=_MAX_THREADS, thread_name_prefix="gradientflow-complete"
                )
    return _pool


def _settle(fut: torch.futures.Future, value: Any, error: BaseException | None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except RuntimeError:
        # Already completed (e.g. failed by shutdown before the transport answered).
        pass


def _unwrap(f: torch.futures.Future) -> Any:
    return f.value()


def new_future() -> tuple[torch.futures.Future, torch.futures.Future]:
    """(source, public): complete `source`; hand out `public`.

    torch's Future.set_exception marks the error on the Python wrapper only: a future that
    crosses C++ (Work.get_future(), DDP's reducer) would then hand the exception object out as
    its value. Chaining through a callback that re-raises turns it into a real C++ error.
    """
    source = torch.futures.Future()
    return source, source.then(_unwrap)


def complete(fut: torch.futures.Future, value: Any = None,
             error: BaseException | None = None) -> None:
    """Set `fut`'s result (or exception) on a pool thread, never on the caller's."""
    _get_pool().submit(_settle, fut, value, error)


def run_async(fn: Callable[[], None]) -> None:
    """Run `fn` on a pool thread."""
    _get_pool().submit(fn)
