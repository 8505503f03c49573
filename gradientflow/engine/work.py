"""The Work handed back for queued operations: a torch Future, plus a wait() that makes progress."""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
from torch._C._distributed_c10d import Work

from gradientflow.engine import completion
from gradientflow.observability.stats import STATS


class FutureWork(Work):
    """A c10d Work over a torch Future whose wait() nudges the engine and honours the timeout.

    torch wraps Python Works so that only wait() and get_future() pass through;
    is_completed() stays False there: use get_future().done().

    One is made per queued allreduce (161 per ResNet-50 step), so it holds plain fields, not
    closures, and the public future (a chained copy whose errors are C++ errors, see
    completion.new_future) is made only when get_future() asks for it. Every object an op keeps
    alive until it completes costs the garbage collector: with 19 per op, its collections were
    a quarter of the issuing cost (world of one, ResNet-50 list: 88 vs 66 us per all_reduce with
    the collector off).
    """

    # Set per Work by the group's inspector (stall.py): a fault it finds (collective mismatch,
    # stall abort) ends a wait early with that fault, checked every `slice_s` seconds. Class
    # defaults, so a Work without an inspector sets neither.
    inspector: Any = None
    slice_s = 1.0

    def __init__(self, fut: torch.futures.Future, owner: Any, seq: int, name: str,
                 fused: bool) -> None:
        super().__init__()
        self._fut = fut  # the source future the engine completes; waited on directly here
        self._owner = owner  # the Engine: describe(), want(), check_not_engine_thread(), timeout_s
        self._seq = seq
        self._name = name
        # A deferred (fused) allreduce: a wait must close its batch (Engine.want), and its
        # public future must be made through Engine.chain.
        self._fused = fused
        self._public: torch.futures.Future | None = None

    def describe(self) -> str:
        return self._owner.describe(self._seq, self._name)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Block until the operation finished; raise its error, or a timeout naming the op."""
        if self._fut.done():
            # Most Works of a fused message are complete by the time they are waited on (a
            # per-tensor loop waits on 161 in a row): no nudge, no timing, and no engine-thread
            # check, since a finished operation cannot deadlock anything.
            STATS.record_wait(0.0)
            return self._result()
        owner = self._owner
        owner.check_not_engine_thread(self.describe)
        if self._fused:
            owner.want(self._seq)
        limit = owner.timeout_s
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        t0 = time.perf_counter()
        finished = self._wait(limit)
        STATS.record_wait(time.perf_counter() - t0)
        if not finished:
            raise RuntimeError(
                f"gradientflow: {self.describe()} did not complete within {limit:.1f} s. "
                "Another rank may not have issued the same collective, may have died, or "
                "may be stalled; check that every rank issues the same collectives in the "
                "same order (GRADIENTFLOW_DEBUG=1 checks it) or raise the timeout of "
                "init_process_group(timeout=...)."
            )
        return self._result()

    def _result(self) -> bool:
        """True, or the finished operation's error (the group's fault, if it has one)."""
        try:
            self._fut.wait()  # re-raises the operation's error, if any
        except Exception:
            # The group's fault (a mismatch, a stall abort) reads better than the raw error.
            fault = self._probe()
            if fault is not None:
                raise fault from None
            raise
        return True

    def _probe(self) -> BaseException | None:
        insp = self.inspector
        return None if insp is None else insp.probe_op(self._fut, self._seq, self._name)

    def _wait(self, limit: float) -> bool:
        fut = self._fut
        if fut.done():
            return True
        # The event is made only for a wait that really blocks: most Works of a fused batch
        # are already complete when their turn to be waited on comes.
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        if self.inspector is None:
            return done.wait(limit)
        deadline = time.monotonic() + limit
        while not done.wait(min(self.slice_s, max(0.0, deadline - time.monotonic()))):
            fault = self._probe()
            if fault is not None:
                raise fault
            if time.monotonic() >= deadline:
                return False
        return True

    def get_future(self) -> torch.futures.Future:
        """The future of this operation (its value: the list of output tensors)."""
        if self._public is None:
            # A fused allreduce's message completes on the reaper, which must hand futures
            # with user callbacks to the pool (Engine.chain).
            self._public = (self._owner.chain(self._seq, self._fut) if self._fused
                            else completion.public(self._fut))
        return self._public

    def is_completed(self) -> bool:
        return self._fut.done()
