"""Completion of Works' futures off the thread that drives the transport.

`Future.set_result` runs `.then` callbacks on the calling thread, and PyTorch's powerSGD_hook
waits on another collective's future inside its callbacks. Completing on the engine thread, or
on one single completion thread, would deadlock it; a pool that grows when every thread is
busy does not: one blocked callback never stops other completions.

The futures of one fused message are settled in order by one pool task (`complete_all`): a
task per future cost a thread wake-up each, 4-7 ms for a 24-tensor message on 2 busy cores,
more than the message's transport. A callback may still block (wait on a later future of the
same message, say): a watchdog hands the rest of the batch to another pool thread when one
settle has run longer than `_HANDOFF_S`, so the guarantee above holds after that delay.
The one exception, `settle`, is for futures nobody else holds (FusedCompletion): no user
callback can run there.

`FusedCompletion` is the last stage of a deferred allreduce: its op is marked done, and a
future is made and settled only if somebody asked for one.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import torch

from gradientflow.threads import follow_torch_threads, following_torch_threads
from gradientflow.errors import StepFailed

# Big enough that blocked callbacks (each waiting on a later collective) cannot starve the
# pool in any realistic program; threads are only created when none is idle.
_MAX_THREADS = 512
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_HANDOFF_S = 0.005  # a settle running longer than this may be blocked: continue elsewhere


def _get_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=_MAX_THREADS, thread_name_prefix="gradientflow-complete",
                    initializer=follow_torch_threads)  # callbacks run torch ops
    return _pool


def _settle(fut: torch.futures.Future, value: Any, error: BaseException | None,
            stream: Any = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        elif stream is not None:
            # A CUDA future records an event on the current stream: the one that produced
            # `value` (see streams.py), not this pool thread's.
            with torch.cuda.stream(stream):
                fut.set_result(value)
        else:
            fut.set_result(value)
    except RuntimeError:
        # Already completed (e.g. failed by shutdown before the transport answered).
        pass


def settle(fut: torch.futures.Future, value: Any, error: BaseException | None = None) -> None:
    """Complete `fut` on this thread: only for a future no user callback can be attached to
    (FusedCompletion decides)."""
    _settle(fut, value, error)


def _unwrap(f: torch.futures.Future) -> Any:
    return f.value()


def new_source(devices: list | None = None) -> torch.futures.Future:
    """A future to complete here; hand out `public(source)` where it may cross into C++.

    `devices`: the CUDA devices of the result (streams.future_devices), None on CPU.
    """
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def public(source: torch.futures.Future) -> torch.futures.Future:
    """`source` chained through a callback that re-raises its error.

    torch's Future.set_exception marks the error on the Python wrapper only: a future that
    crosses C++ (Work.get_future(), DDP's reducer) would then hand the exception object out as
    its value. Chaining through a callback that re-raises turns it into a real C++ error.
    """
    return source.then(_unwrap)


def new_future(devices: list | None = None) -> tuple[torch.futures.Future, torch.futures.Future]:
    """(source, public): complete `source`; hand out `public`."""
    source = new_source(devices)
    return source, public(source)


def complete(fut: torch.futures.Future, value: Any = None,
             error: BaseException | None = None, stream: Any = None) -> None:
    """Set `fut`'s result (or exception) on a pool thread, never on the caller's.

    `stream`: the CUDA stream that produced `value`, made current for the completion.
    """
    _get_pool().submit(_settle, fut, value, error, stream)


class _Batch:
    """Futures settled in order by whichever pool threads claim them (each exactly once)."""

    def __init__(self, items: list[tuple[torch.futures.Future, Any, BaseException | None]],
                 stream: Any = None):
        self.items = items
        self.stream = stream
        self.next = 0
        self.since = 0.0  # when the settle now running began (monotonic)
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            with self.lock:
                i = self.next
                if i >= len(self.items):
                    return
                self.next = i + 1
                self.since = time.monotonic()
            _settle(*self.items[i], self.stream)

    def stalled(self, now: float) -> bool:
        """Whether items remain behind a settle that has run longer than the hand-off time."""
        with self.lock:
            if self.next >= len(self.items):
                return False
            if now - self.since < _HANDOFF_S:
                return False
            self.since = now  # one continuation per stall period
            return True

    @property
    def finished(self) -> bool:
        return self.next >= len(self.items)


class _Watchdog:
    """One daemon thread watching the batches in progress; idle (no wake-ups) without any."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._batches: list[_Batch] = []
        self._thread: threading.Thread | None = None

    def add(self, batch: _Batch) -> None:
        with self._cv:
            self._batches.append(batch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=following_torch_threads(self._run),
                                                daemon=True,
                                                name="gradientflow-complete-watchdog")
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._batches = [b for b in self._batches if not b.finished]
                while not self._batches:
                    self._cv.wait()
                batches = list(self._batches)
            now = time.monotonic()
            for b in batches:
                if b.stalled(now):
                    _get_pool().submit(b.run)
            with self._cv:
                self._cv.wait(_HANDOFF_S)


_watchdog = _Watchdog()


def follow(done: Any, fut: torch.futures.Future, outputs: Any,
           fail: Any) -> None:
    """Complete `fut` with `outputs` from the transport's finished future `done`: a StepFailed
    (agreed on every rank) fails only this op; any other error fails the group (`fail(exc)`
    returns the group's error)."""
    try:
        done.value()
        complete(fut, outputs)
    except StepFailed as exc:  # [algorithms] agreed on every rank: the group goes on
        complete(fut, error=exc)
    except BaseException as exc:  # noqa: BLE001 - a transport failure: the group is broken
        complete(fut, error=fail(exc))


def complete_all(items: list[tuple[torch.futures.Future, Any, BaseException | None]],
                 stream: Any = None) -> None:
    """Settle several futures, in order, off the caller's thread (one pool task for all).

    items: (future, value, error) triples. A callback that blocks delays the rest by at most
    about `_HANDOFF_S` (the watchdog continues the batch on another pool thread). `stream`:
    as in `complete`.
    """
    _get_pool().submit(_settle_in_order, items, stream)


def _settle_in_order(items: list[tuple[torch.futures.Future, Any, BaseException | None]],
                     stream: Any = None) -> None:
    """complete_all's pool task: settle in order; the watchdog covers a blocked callback."""
    batch = _Batch(items, stream)
    if len(items) > 1:
        _watchdog.add(batch)
    batch.run()


class FusedCompletion:
    """Completion of deferred (fused) allreduces: `done` flags, futures only on demand.

    A CPU op is made without a future: the reaper marks it done (with its error) and settles
    its future only if a blocking wait or get_future() asked for one meanwhile. Settling a
    future per op, and a pool hop per message, cost more than the rest of a message's
    completion; a per-tensor loop asks for neither. The lock orders a Work asking for a
    future (future_of) against the reaper finishing its op (finish): either the reaper sees
    the future, or future_of sees the op done and settles the future it makes itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def future_of(self, op: Any, for_user: bool = False) -> torch.futures.Future | None:
        """The future of fused op `op`, made now if it has none.

        For a blocking wait (`for_user` False): None if the op is already done. For
        get_future() (`for_user` True): its public future; if `op` is not done yet, it is marked
        `chained`, so its completion runs on the pool, never on the reaper, where a user
        callback that blocks would stall every later message.
        """
        with self._lock:
            fut = op.fut
            if fut is None:
                if op.done and not for_user:
                    return None
                fut = op.fut = new_source()
                if op.done:  # nothing is attached to it yet: settle it here
                    settle(fut, [op.tensor], op.error)
            if for_user:
                if not fut.done():
                    op.chained = True
                return public(fut)
            return fut

    def finish(self, ops: list, error: BaseException | None) -> None:
        """Mark fused ops done (values written back, or failed with `error`) and settle the
        futures somebody asked for: here when only our own wait() is attached to them, on the
        pool (which a blocked callback cannot stall) when get_future() handed them out."""
        pooled = []
        with self._lock:
            for op in ops:
                if op.done:  # a failure path reaching ops that already finished
                    continue
                op.error = error
                op.done = True
                fut = op.fut
                if fut is not None:
                    if op.chained or error is not None:
                        pooled.append((fut, [op.tensor], error))
                    else:
                        settle(fut, [op.tensor])
        if pooled:
            complete_all(pooled)

