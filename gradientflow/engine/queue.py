"""The engine's ordered queue: issued ops waiting for agreement, agreed ops waiting to launch.

Two deques under the engine's lock. `issued` holds every op in sequence order until it is
ordered: a deferred allreduce (FusableOp) or a stage op (StagesOp, a compressed bucket) waits
there for its batch's agreement round, any other op (EagerOp) moves to `agreed` once
everything before it is ordered. `agreed` is the transport order: fused messages, solo
tensors, eager ops and fused stage batches, launched strictly in that order; a message waits
there (not on the engine thread) for a free segment, so the engine can agree the next batch
meanwhile.

The *run* is the leading ops of `issued` of one kind (deferred allreduces, or stage ops): one
round agrees a prefix of it. A run of stage ops is closed only by what the call sequence says
(the fusion threshold in dense bytes, an op marked `close` such as a step's last bucket,
another collective behind it, or a flush), never by the cycle time, so which buckets share a
batch, and so which chunks CSC selects across them, does not depend on timing.

`next_job` is the engine thread's whole scheduling policy: launch the head of `agreed` if it
can go, otherwise order the head of `issued`, otherwise start a round when a local reason says
so (`_should_round`) and no eager op's round is still to run (rounds pair in sequence order).
Every decision here is local; what pairs across ranks is decided by the round (rounds.py) and
the pure cut (fusion.plan_messages).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable

from gradientflow.engine.agreement import MAX_BATCH
from gradientflow.engine.fusion import FusableOp, Message, plan_messages
from gradientflow.engine.jobs import AgreeBatch, EagerOp, Prepare, SendMessage, StagesBatch
from gradientflow.engine.stages import StagesOp, plan_batches

MAX_WAIT_CYCLES = 5  # longest a partial batch waits for a quiet caller, in cycle times
BUSY_QUIET_CYCLES = 5  # how long a caller must be quiet while the transport is busy, in cycles
# A run of stage ops that nothing closes (a caller that never marks its last op) is agreed
# after this long anyway, so it cannot wait for ever.
STAGES_STALL_S = 5.0
_RUN_KINDS = (FusableOp, StagesOp)


class OrderedQueue:
    """Issued and agreed ops of one engine, and when to agree the next batch (lock held)."""

    def __init__(self, config: Any, acquire: Callable[[Message], Any],
                 in_flight: Callable[[], bool]) -> None:
        self.configure(config)
        self._acquire = acquire  # a free segment for a message, or None (messages.py)
        self._in_flight = in_flight  # whether messages (the solo channel's too) are in flight
        self.issued: collections.deque = collections.deque()
        self.agreed: collections.deque = collections.deque()
        # Stage ops whose part has local work to do ahead of its batch (`part.prepare()`).
        self.to_prepare: collections.deque = collections.deque()
        self.run_len = 0  # leading ops of one kind (deferred allreduces or stage ops) in `issued`
        self.run_kind: type | None = None
        self.run_bytes = 0
        self.run_closed = False  # a stage op of the run is marked close
        self.run_since = 0.0
        self.last_submit = 0.0  # when the last deferred or solo op was issued (the quiet rule)
        self.wanted_upto = -1  # highest seq somebody waits on (or flushed)
        self.busy = False  # the engine thread is running a job
        # A caller runs an eager call's round and launch itself (jobs.Claim): no other round
        # or send may start until it is done, so the engine thread waits.
        self.floor = False
        # Blocks of allreduces the caller will wait on as one (Engine.waited): their round
        # waits for the block's end.
        self.held = 0

    def configure(self, config: Any) -> None:
        """Take the cut and the cycle time of `config` (at creation, or Engine.reconfigure)."""
        self._threshold = config.fusion_threshold
        self._solo_threshold = config.solo_threshold
        self._cycle = config.cycle_time_ms / 1000.0

    def idle(self) -> bool:
        """Nothing queued: an eager op may go on the caller's thread."""
        return not self.issued and not self.agreed

    def push_fused(self, op: FusableOp, waited: bool) -> tuple[bool, bool]:
        """Queue a deferred allreduce; returns (wake the engine, the threshold was crossed).

        The engine is woken only when this op changes its decision: a timed wait (the cycle
        time) re-reads `last_submit` when it ends anyway, and a wake-up per op costs the
        issuing thread a GIL hand-off (a per-tensor loop issues one every few us).
        """
        issued = self.issued
        joined = self._extend_run(op)
        issued.append(op)
        self.last_submit = time.monotonic()
        if waited and op.seq > self.wanted_upto:
            self.wanted_upto = op.seq
        thr = self._threshold
        crossed = joined and self.run_bytes >= thr > self.run_bytes - op.nbytes
        wake = (len(issued) == 1 or waited or self.run_len < len(issued)
                or self.run_bytes >= thr)
        return wake, crossed

    def push_stages(self, op: StagesOp) -> None:
        """Queue a stage op (the engine is woken by the caller)."""
        if self._extend_run(op) and op.close:
            self.run_closed = True
        self.issued.append(op)
        if hasattr(op.part, "prepare"):
            self.to_prepare.append(op)
        self.last_submit = time.monotonic()

    def _extend_run(self, op: Any) -> bool:
        """Count `op`, about to be appended to `issued`, into the leading run if it joins it;
        whether it did. A run ends at an op marked close: what follows starts the next."""
        if self.run_len != len(self.issued) or (self.run_len and self.run_kind is not type(op)):
            return False
        if self.run_closed:
            return False
        if self.run_len == 0:
            self.run_since = time.monotonic()
            self.run_kind = type(op)
        self.run_len += 1
        self.run_bytes += op.nbytes
        return True

    def take_batch(self, n: int) -> None:
        """The first `n` issued ops were agreed: cut them into messages (deferred allreduces)
        or fused batches (stage ops), in transport order."""
        batch = [self.issued.popleft() for _ in range(n)]
        kind = self.run_kind
        self._recount_run()
        if kind is StagesOp:
            self.agreed.extend(StagesBatch(ops) for ops in plan_batches(batch, self._threshold))
            return
        self.agreed.extend(plan_messages(batch, self._threshold, self._solo_threshold))

    def refuse(self, n: int) -> list:
        """The first `n` issued ops, removed: a round refused them on every rank."""
        batch = [self.issued.popleft() for _ in range(n)]
        if self.to_prepare:
            gone = {id(op) for op in batch}
            self.to_prepare = collections.deque(op for op in self.to_prepare
                                                if id(op) not in gone)
        self._recount_run()
        return batch

    def drain(self) -> list:
        """Everything not yet handed to the transport, removed (to fail it)."""
        items = list(self.agreed) + list(self.issued)
        self.agreed.clear()
        self.issued.clear()
        self.to_prepare.clear()
        self.run_len = self.run_bytes = 0
        self.run_closed = False
        return items

    def _recount_run(self) -> None:
        """Recompute the leading run (its kind, length, bytes, whether an op closes it) after
        the head of `issued` changed."""
        self.run_len = 0
        self.run_bytes = 0
        self.run_closed = False
        issued = self.issued
        kind = self.run_kind = type(issued[0]) if issued else None
        if kind not in _RUN_KINDS:
            return
        for op in issued:
            if type(op) is not kind:
                break
            self.run_len += 1
            self.run_bytes += op.nbytes
            if kind is StagesOp and op.close:
                self.run_closed = True
                break
        self.run_since = time.monotonic()

    def _should_round(self, now: float) -> tuple[bool, float | None]:
        """Whether to start the agreement round for the leading batch now (local reasons)."""
        if self.held:  # the caller is still issuing a block it will wait on (Engine.waited)
            return False, None
        if self.run_len < len(self.issued):  # another collective is queued behind the batch
            return True, None
        if self.wanted_upto >= self.issued[0].seq or self.run_bytes >= self._threshold:
            return True, None
        if self.run_kind is StagesOp:
            if self.run_closed:
                return True, None
            left = self.last_submit + STAGES_STALL_S - now
            return (left <= 0), (left if left > 0 else None)
        # The cycle time (Horovod's): a partial batch is agreed once the caller has been quiet
        # for one cycle, so a batch keeps growing while the caller issues (bigger messages,
        # fewer rounds), at most MAX_WAIT_CYCLES cycles while the transport is idle, so latency
        # stays bounded. With messages in flight there is no bound: waiting for the transport
        # to drain would serialise the tail of a list behind what is in flight, and a pause
        # counts only after BUSY_QUIET_CYCLES cycles, since a caller descheduled for one cycle
        # while solos leave is not a quiet one.
        cycle = self._cycle
        idle = not self._in_flight()
        left = self.last_submit + (cycle if idle else BUSY_QUIET_CYCLES * cycle) - now
        if idle:
            left = min(left, self.run_since + MAX_WAIT_CYCLES * cycle - now)
        return (left <= 0), (left if left > 0 else None)

    def next_job(self) -> tuple[Any, float | None]:
        """The engine's next job, or None to wait (lock held); also the wait's timeout."""
        if self.floor:
            return None, None
        agreed = self.agreed
        if agreed:
            head = agreed[0]
            if not isinstance(head, Message):
                return agreed.popleft(), None
            if head.solo:
                agreed.popleft()
                return SendMessage(head, None, head.ops[0].tensor), None
            acquired = self._acquire(head)
            if acquired is not None:
                agreed.popleft()
                return SendMessage(head, *acquired), None
            # Blocked on a segment: a release wakes us. A batch's round may run meanwhile,
            # unless an eager op's round waits behind the message (below).
        issued = self.issued
        while issued and not isinstance(issued[0], _RUN_KINDS):
            agreed.append(issued.popleft())
            self._recount_run()
        if agreed and not isinstance(agreed[0], Message):
            return agreed.popleft(), None
        if self.to_prepare:
            # Before any round: a round waits for the slowest rank, this uses that time.
            return Prepare(self.to_prepare.popleft()), None
        if not issued:
            return None, None
        if any(type(item) is EagerOp and item.check is not None for item in agreed):
            # An eager op behind a message that waits for a segment has not had its round (it
            # runs at its launch). Rounds pair across ranks in the order they run, so no later
            # batch's round may pass it: a rank whose segment was free would run that round
            # first, and the ranks would meet different rounds.
            return None, None
        go, delay = self._should_round(time.monotonic())
        if go:
            # Snapshot of the local batch candidates, capped so the round's words stay valid.
            # (A stage run's round needs no more: it is cut by plan_batches after agreement.)
            return AgreeBatch([issued[i] for i in range(min(self.run_len, MAX_BATCH))]), None
        return None, delay
