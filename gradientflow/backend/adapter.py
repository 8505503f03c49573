"""The transport as the engine uses it: a c10d process group that takes every dtype and
gives every Work a future.

gloo lacks kernels for some dtypes (dtypes.py says which, and how they travel instead), and
its reduce-scatter Works have no future ("Work::getFuture not implemented"), which the
engine's queued path and Horovod's poll() need. A synchronous call that returns no Work (NCCL's,
asyncOp False) returns none here either. `Transport` wraps one process group; every method it
does not adapt is the group's own.
"""
from __future__ import annotations

import datetime
import threading
from collections import deque
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import Work

from gradientflow.threads import following_torch_threads
from gradientflow.backend.dtypes import (MOVE, REDUCE, NarrowedWork, bits_args, narrow_,
                                         widen_args)

# Transport methods whose gloo Works have no future of their own.
_NO_FUTURE = frozenset({"reduce_scatter", "_reduce_scatter_base"})


class _Waiter:
    """One thread per transport that waits, in launch order, on the Works that have no future
    and settles a future for each (launch order is completion order on one transport)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def future_of(self, work: Any, result: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._cv:
            self._items.append((work, fut, result))
            if self._thread is None:
                self._thread = threading.Thread(target=following_torch_threads(self._main),
                                                daemon=True, name=f"{self._name}-waiter")
                self._thread.start()
            self._cv.notify()
        return fut

    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                work, fut, result = self._items.popleft()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                fut.set_exception(exc)
                continue
            fut.set_result(result)


class FutureWork(Work):
    """A transport Work whose future is settled by the transport's waiter thread."""

    def __init__(self, inner: Any, waiter: _Waiter, result: Any) -> None:
        super().__init__()
        self._inner = inner
        self._waiter = waiter
        self._result = result
        self._fut: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Wait for the operation (its own wait)."""
        if timeout is None:
            return self._inner.wait()
        return self._inner.wait(timeout)

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = self._waiter.future_of(self._inner, self._result)
            return self._fut

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class Transport:
    """A transport (a c10d process group) that takes every dtype and whose every Work has a
    future; everything else is the group's own."""

    def __init__(self, pg: Any, name: str = "transport") -> None:
        self._pg = pg
        self._waiter = _Waiter(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    @property
    def group(self) -> Any:
        """The process group this transport adapts (gloo's or NCCL's)."""
        return self._pg

    def _move(self, name: str, args: tuple) -> Any:
        return getattr(self._pg, name)(*bits_args(name, args))

    def _reduce(self, name: str, args: tuple) -> Any:
        widened = widen_args(name, args)
        if widened is None:
            work = getattr(self._pg, name)(*args)
        else:
            staged, pairs, ordered = widened
            work = getattr(self._pg, name)(*staged)
        result = args[REDUCE[name][1][0]]
        if work is None:
            # A synchronous call done in the call (NCCL returns no Work when asyncOp is
            # False): the wide copies are reduced, so they are narrowed now.
            if widened is not None:
                for out, wide in pairs:
                    narrow_(out, wide, ordered)
            return None
        if name in _NO_FUTURE:
            work = FutureWork(work, self._waiter, result)
        if widened is not None:
            work = NarrowedWork(work, pairs, ordered, result)
        return work


def _method(name: str, reduce: bool) -> Callable:
    def call(self: Transport, *args: Any) -> Any:
        return self._reduce(name, args) if reduce else self._move(name, args)

    call.__name__ = name
    call.__doc__ = f"The transport's {name}, adapted (module doc)."
    return call


for _n in MOVE:
    setattr(Transport, _n, _method(_n, False))
for _n in REDUCE:
    setattr(Transport, _n, _method(_n, True))


def adapted(factory: Callable[..., Any]) -> Callable[..., Any]:
    """A transport factory whose transports are adapted (module doc)."""

    def make(*args: Any, **kwargs: Any) -> Transport:
        return Transport(factory(*args, **kwargs), f"gradientflow-{args[-1] if args else ''}")

    make.__name__ = getattr(factory, "__name__", "make")
    return make
