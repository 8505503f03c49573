"""The solo channel's own thread: its allreduces checked in batches, then sent, in issue order.

A solo allreduce (issue.py) leaves during the caller's issuing loop, overtaking the deferred
batch before it. It must still be checked on every rank before it is sent, on its own stream
(rounds on the solo transport, pairing only with solo calls). Done on the caller's thread,
each round would stop the loop until every rank reached that tensor; here the caller only
queues the op, and this thread agrees the solo ops queued so far in one round (as many as
every rank has queued: Rounds.agree), then sends them. A rank blocked on an earlier deferred
op still runs its solo rounds here, and its engine thread the batch rounds, so no rank waits
for a solo another cannot send.

Items that are not checked (a barrier's solo part) go in their place in the queue.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from gradientflow.engine import completion
from gradientflow.engine.agreement import MAX_BATCH
from gradientflow.engine.checks import Check
from gradientflow.threads import following_torch_threads
from gradientflow.errors import CollectiveMismatchError


class SoloOp:
    """A queued solo allreduce: its Check, its launch, its future (what its Work waits on)."""

    __slots__ = ("check", "launch", "outputs", "fut", "nbytes", "numel")

    def __init__(self, check: Check | None, launch: Callable[[], Any], outputs: Any,
                 fut: Any, nbytes: int = 0, numel: int = 0) -> None:
        self.check = check  # None: not checked (a barrier's solo part)
        self.launch = launch
        self.outputs = outputs
        self.fut = fut
        self.nbytes = nbytes
        self.numel = numel

    @property
    def seq(self) -> int:
        return self.check.seq

    @property
    def fingerprint(self) -> int:
        return self.check.fingerprint

    def describe(self) -> str:
        return self.check.describe()


class SoloChannel:
    """The solo channel's queue and thread. `rounds()` gives the solo transport's Rounds
    (made at the first op); `sent(op, work)` records a launched op (engine lock taken);
    `fail(exc)` fails the group; `refused(seqs)` tells the inspector."""

    def __init__(self, name: str, rounds: Callable[[], Any], sent: Callable[[SoloOp, Any], None],
                 fail: Callable[[BaseException], BaseException],
                 refused: Callable[[list], None]) -> None:
        self._name = name
        self._rounds = rounds
        self._sent = sent
        self._fail = fail
        self._refused = refused
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.pending: set = set()  # sequence numbers queued or in their round (frontier)

    def submit(self, op: SoloOp) -> None:
        """Queue `op` (in issue order: the caller holds the engine's lock)."""
        with self._cv:
            self._queue.append(op)
            if op.check is not None:
                self.pending.add(op.check.seq)
            if self._thread is None:
                self._thread = threading.Thread(target=following_torch_threads(self._main),
                                                daemon=True, name=f"{self._name}-solo")
                self._thread.start()
            self._cv.notify()

    def close(self, timeout_s: float) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _next(self) -> list | None:
        """The leading run of checked ops (at most a round's worth), or one unchecked item."""
        with self._cv:
            while not self._queue:
                if self._closing:
                    return None
                self._cv.wait()
            if self._queue[0].check is None:
                return [self._queue.popleft()]
            batch = []
            while self._queue and self._queue[0].check is not None and len(batch) < MAX_BATCH:
                batch.append(self._queue.popleft())
            return batch

    def _main(self) -> None:
        while True:
            batch = self._next()
            if batch is None:
                return
            try:
                self._run(batch)
            except BaseException as exc:  # noqa: BLE001 - the group is broken: fail what waits
                err = self._fail(exc)
                for op in batch:
                    completion.complete(op.fut, error=err)
                self._drain(err)
                return

    def _run(self, batch: list) -> None:
        if batch[0].check is not None:
            waited = all(op.check.waited for op in batch)
            try:
                n = self._rounds().agree(batch, waited)
            except CollectiveMismatchError as err:
                n = getattr(err, "refused", None)
                if not n:
                    raise
                self._refused([op.seq for op in batch[:n]])
                with self._cv:
                    for op in batch[:n]:
                        self.pending.discard(op.seq)
                for op in batch[:n]:
                    completion.complete(op.fut, error=err)
                self._requeue(batch[n:])
                return
            self._requeue(batch[n:])  # queued on this rank only so far: the next round
            batch = batch[:n]
        for op in batch:
            work = op.launch()
            self._sent(op, work)
            work.get_future().then(
                lambda f, op=op: completion.follow(f, op.fut, op.outputs, self._fail))
        with self._cv:
            for op in batch:
                if op.check is not None:
                    self.pending.discard(op.check.seq)

    def _requeue(self, rest: list) -> None:
        if rest:
            with self._cv:
                self._queue.extendleft(reversed(rest))

    def _drain(self, err: BaseException) -> None:
        with self._cv:
            items, self._queue = list(self._queue), collections.deque()
            self.pending.clear()
        for op in items:
            completion.complete(op.fut, error=err)

