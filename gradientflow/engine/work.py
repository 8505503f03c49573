"""The Works handed back for queued operations: a wait() that makes progress and honours faults."""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Protocol

import torch
from torch._C._distributed_c10d import Work

from gradientflow.engine import completion
from gradientflow.observability.stats import STATS


class WorkOwner(Protocol):
    """What a Work asks of the engine that made it (Engine has these)."""

    timeout_s: float

    def describe(self, seq: int, name: str) -> str: ...

    def want(self, seq: int) -> None: ...

    def check_not_engine_thread(self, describe: Callable[[], str]) -> None: ...

    def future_of(self, op: Any, for_user: bool = False) -> torch.futures.Future | None: ...


class FutureWork(Work):
    """A c10d Work over a torch Future whose wait() honours the timeout and the group's faults.

    torch wraps Python Works so that only wait() and get_future() pass through;
    is_completed() stays False there: use get_future().done().

    The public future (a chained copy whose errors are C++ errors, see completion.new_future)
    is made only when get_future() asks for it: every object an op keeps alive until it
    completes costs the garbage collector, on the issuing thread.
    """

    # Set per Work by the group's inspector (gradientflow/inspector): a fault it finds
    # (collective mismatch, stall abort) ends a wait early with that fault, checked every
    # `slice_s` seconds. Class defaults, so a Work without an inspector sets neither.
    inspector: Any = None
    slice_s = 1.0

    def __init__(self, fut: torch.futures.Future | None, owner: WorkOwner, seq: int,
                 name: str) -> None:
        super().__init__()
        self._fut = fut  # the source future the engine completes
        self._owner = owner
        self._seq = seq
        self._name = name
        self._public: torch.futures.Future | None = None

    def describe(self) -> str:
        return self._owner.describe(self._seq, self._name)

    # Hooks FusedWork overrides: whether it finished, the future to block on, a nudge.
    def _finished(self) -> bool:
        return self._fut.done()

    def _blocking_future(self) -> torch.futures.Future | None:
        """The future a blocking wait waits on (None: it finished meanwhile)."""
        return self._fut

    def _nudge(self) -> None:
        """Somebody blocks on this op: the batch before it closes soon, and a round that
        refuses it may keep the group usable (the caller gets the error at once)."""
        self._owner.want(self._seq)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Block until the operation finished; raise its error, or a timeout naming the op."""
        if self._finished():
            # Most Works of a fused message are complete by the time they are waited on (a
            # per-tensor loop waits on 161 in a row): no nudge, no timing, and no engine-thread
            # check, since a finished operation cannot deadlock anything.
            STATS.record_wait(0.0)
            return self._result()
        owner = self._owner
        owner.check_not_engine_thread(self.describe)
        self._nudge()
        limit = owner.timeout_s
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        t0 = time.perf_counter()
        fut = self._blocking_future()
        finished = fut is None or self._wait(fut, limit)
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

    def _error(self) -> BaseException | None:
        """The finished operation's error, or None."""
        try:
            self._fut.wait()  # re-raises the operation's error, if any
        except Exception as exc:  # noqa: BLE001 - returned to be raised with the group's fault
            return exc
        return None

    def _result(self) -> bool:
        """True, or the finished operation's error (the group's fault, if it has one)."""
        error = self._error()
        if error is None:
            return True
        # The group's fault (a mismatch, a stall abort) reads better than the raw error.
        insp = self.inspector
        fault = None if insp is None else insp.probe_error(error, self._seq, self._name)
        raise (fault or error) from None

    def _probe(self) -> BaseException | None:
        """The fault a blocked wait should end with now (none while the op is running)."""
        insp = self.inspector
        return None if insp is None else insp.probe()

    def _wait(self, fut: torch.futures.Future, limit: float) -> bool:
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
            self._public = completion.public(self._fut)
        return self._public

    def is_completed(self) -> bool:
        return self._finished()


class FusedWork(FutureWork):
    """The Work of a deferred (fused) allreduce: its op's `done` flag, no future of its own
    until a blocking wait or get_future() asks the engine for one (completion.FusedCompletion).

    A wait on a queued op closes its batch (Engine.want); its public future is made by the
    engine, which settles futures with user callbacks on the pool, never on its reaper.
    """

    def __init__(self, op: Any, owner: WorkOwner) -> None:
        super().__init__(op.fut, owner, op.seq, op.name)
        self._op = op

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Block until the operation finished; raise its error, or a timeout naming the op."""
        op = self._op
        if op.done and op.error is None:  # CPU: the common case, kept to two reads
            STATS.record_wait(0.0)
            return True
        return super().wait(timeout)

    def _finished(self) -> bool:
        op = self._op
        return op.done or (op.fut is not None and op.fut.done())

    def _blocking_future(self) -> torch.futures.Future | None:
        return self._owner.future_of(self._op)

    def _nudge(self) -> None:
        self._owner.want(self._op.seq)

    def _error(self) -> BaseException | None:
        op = self._op
        if op.done:  # CPU, or a failure: the engine recorded the error (or None)
            return op.error
        return super()._error()  # CUDA: its future's wait() also syncs the caller's stream

    def get_future(self) -> torch.futures.Future:
        if self._public is None:
            self._public = self._owner.future_of(self._op, for_user=True)
        return self._public


class AllWork(Work):
    """Several Works as one, for an operation made of several transport calls (a barrier on the
    main transport and the solo channel; a coalesced collective built from per-tensor ones):
    wait() waits on each in order; the future's value is `value`, or the last Work's value."""

    def __init__(self, works: list, value: Any = None) -> None:
        super().__init__()
        self._works = works
        self._value = value

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Block until every Work finished; raise the first error."""
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        """Completes once every Work completed (the first error re-raised), with the value."""
        every = torch.futures.collect_all([w.get_future() for w in self._works])
        return every.then(self._settle)

    def _settle(self, fut: torch.futures.Future) -> Any:
        last = None
        for f in fut.value():
            last = f.value()  # re-raises its error
        return last if self._value is None else self._value

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

