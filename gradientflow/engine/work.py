"""The Work handed back for queued operations: a torch Future, plus a wait() that makes progress."""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable

import torch
from torch._C._distributed_c10d import Work

from gradientflow.observability.stats import STATS


_CALLBACK_PREFIX = "Got the following error when running the callback: "


def _unwrap(text: str) -> RuntimeError:
    """The error a torch Future chain re-raised, without its prefix and C++ stack ("At: ...")."""
    from gradientflow.engine.engine import EngineError

    text = text[len(_CALLBACK_PREFIX):].split("\n\nAt:\n", 1)[0].rstrip()
    for prefix in ("EngineError: ", "CollectiveMismatchError: ", "RuntimeError: "):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return EngineError(text)


class FutureWork(Work):
    """A c10d Work over a torch Future whose wait() nudges the engine and honours the timeout.

    torch wraps Python Works so that only wait() and get_future() pass through;
    is_completed() stays False there: use get_future().done().
    """

    def __init__(self, fut: torch.futures.Future, describe: Callable[[], str],
                 timeout_s: float, nudge: Callable[[], None] | None = None,
                 check_thread: Callable[[Callable[[], str]], None] | None = None) -> None:
        super().__init__()
        self._fut = fut
        self._describe = describe
        self._timeout_s = timeout_s
        self._nudge = nudge
        self._check_thread = check_thread
        # Set by the group's inspector (stall.py): a fault it finds (collective mismatch,
        # stall abort) ends a wait early with that fault, checked every `slice_s` seconds.
        self.probe: Callable[[], BaseException | None] | None = None
        self.slice_s = 1.0

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Block until the operation finished; raise its error, or a timeout naming the op."""
        if self._check_thread is not None:
            self._check_thread(self._describe)
        if self._nudge is not None and not self._fut.done():
            self._nudge()
        limit = self._timeout_s
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        t0 = time.perf_counter()
        finished = self._wait(limit)
        STATS.record_wait(time.perf_counter() - t0)
        if not finished:
            raise RuntimeError(
                f"gradientflow: {self._describe()} did not complete within {limit:.1f} s. "
                "Another rank may not have issued the same collective, may have died, or "
                "may be stalled; check that every rank issues the same collectives in the "
                "same order (GRADIENTFLOW_DEBUG=1 checks it) or raise the timeout of "
                "init_process_group(timeout=...)."
            )
        try:
            self._fut.wait()  # re-raises the operation's error, if any
        except Exception as exc:
            # The group's fault (a mismatch, a stall abort) reads better than its echo through
            # the future's callback chain ("Got the following error when running the callback").
            fault = self.probe() if self.probe is not None else None
            if fault is not None:
                raise fault from None
            text = str(exc)
            if text.startswith(_CALLBACK_PREFIX):
                raise _unwrap(text) from exc
            raise
        return True

    def _wait(self, limit: float) -> bool:
        if self._fut.done():
            return True
        # The event is made only for a wait that really blocks: most Works of a fused batch
        # are already complete when their turn to be waited on comes.
        done = threading.Event()
        self._fut.add_done_callback(lambda _f: done.set())
        probe = self.probe
        if probe is None:
            return done.wait(limit)
        deadline = time.monotonic() + limit
        while not done.wait(min(self.slice_s, max(0.0, deadline - time.monotonic()))):
            fault = probe()
            if fault is not None:
                raise fault
            if time.monotonic() >= deadline:
                return False
        return True

    def get_future(self) -> torch.futures.Future:
        """The future of this operation (its value: the list of output tensors)."""
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()
