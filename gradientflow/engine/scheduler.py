"""Keyed scheduling: launch gradient partitions in priority order among those ready on EVERY rank.

The DistributedOptimizer's partitions become ready during backward in timing-dependent order,
which differs between ranks. Launching "the most urgent ready partition" from local state would
pair different partitions across ranks. So launch decisions come from agreement rounds: every rank
contributes a bit per locally ready key (and how much of the launch sequence it has seen
complete, as a thermometer code), their AND over ranks is what holds everywhere (round_bits),
and the launch order is a pure function
of that agreed state and the static priorities (TicTac's order: the partition the next forward
pass needs first goes first). A credit bounds the agreed bytes in flight, so a newly ready
first-layer partition is not queued behind many late ones (ByteScheduler's credit).

What the call sequence decides, and what local time decides:

- WHICH rounds happen: one chain per step. Round i+1 is due iff the agreed state after round i
  leaves some key of the step not agreed ready everywhere (the same answer on every rank), so
  every rank issues the same rounds, numbered alike in issue order, whatever its timing: rounds
  pair without polling, and a rank never has to answer a round it did not start itself. The
  step's last round is the one that agrees its last key; it launches everything left. begin()
  of the next step waits until the previous step's transfers completed here, so a step's rounds
  are all issued before the next step's. Rounds are chained, not one per event, because each
  costs every rank CPU time.
- WHAT each round decides: the launches after round i are a function of round i's result (the
  keys ready everywhere, the launch-sequence prefix complete everywhere) and of the rounds
  before it, processed in index order; once every key is agreed, everything left is launched.
  So the sequence of launches on the transport (which gloo/NCCL pair by issue order) is the
  same on every rank. The credit holds an agreed op back only while the credit is spent AND a
  key not agreed yet has a better static priority (begin(priorities)), i.e. only when holding
  can change the order: in FIFO order nothing is ever held.
- WHEN: local. A rank issues a due round once it has processed its previous one (at most one
  of its rounds is in flight) and it has news: a key ready here and not agreed, or, while the
  credit holds ops back, a completion here that the agreed state does not count yet. Whatever
  happens while a round is in flight goes into the next one together (batching without a
  timer). The issuing thread is the one that saw the news (backward's hook thread, the
  transport's thread, or the agreement group's thread right after processing the previous
  round); liveness needs no completion: every rank eventually submits every key. A rank with
  nothing new does nothing.

Dense partitions use submit_tensor(): packed by the caller (backward's hook thread), sent as one
asynchronous allreduce, and completed on the transport's thread without running a generator or
a pool hand-off, so the caller unpacks on the thread that waits. Single-stage generator ops
(submit(single_stage=True)) are primed on the caller's thread and resumed by the transport's
completion. Multi-stage ops (compressed or sparse) run their stages back to back on the
scheduler's executor thread, which also takes every launch queued behind one, so their later
stages enter the transport at the same point of the sequence on every rank.

Why a stream of its own (its own agreement group, its own transport group, its own thread):
rounds of the sequence engine are positioned by the call sequence of collectives, keyed rounds by
readiness counts. Sharing one queue would let rank 0 wait in a keyed round while rank 1 waits in
a sequenced collective for rank 0: a deadlock. Two independent ordered streams cannot wait on
each other, and each is consistent across ranks on its own.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.engine import completion, streams
from gradientflow.engine.agreement import MAX_KEYS, read_bits, round_bits
from gradientflow.engine.stages import StageGen
from gradientflow.observability import timeline as tl
from gradientflow.observability.stats import STATS
from gradientflow.observability.timeline import TIMELINE, now_us

# Ops kept in flight whatever the byte credit: two in flight keep the transport busy while the
# next is issued, a third covers the agreement round that frees the next credit. Holding back
# costs, which is why the credit only holds an op while a more urgent key may still overtake
# it (_decide).
MIN_IN_FLIGHT = 3


@dataclass
class KeyedOp:
    """One partition's op, waiting for its key to be agreed ready everywhere."""

    key: int
    priority: int
    gen: StageGen | None  # None: submit_tensor (one allreduce, no generator)
    device: torch.device
    nbytes: int
    fut: torch.futures.Future
    first: torch.Tensor | None = None  # single-stage ops: the packed tensor, primed at submit
    step: int = 0  # the step that submitted it
    seq: int = -1  # position in the launch sequence (the same on every rank)
    t_launch: float = 0.0
    ready: Any = None  # CUDA: streams.mark() of the submitting thread's stream (after packing)


class KeyedScheduler:
    """Agrees on ready keys with the other ranks and launches their ops in priority order."""

    def __init__(self, rank: int, world_size: int, agree_group: Any,
                 transport_for: Callable[[torch.device], Any], credit_bytes: int,
                 timeout_s: float, name: str = "gradientflow") -> None:
        self.rank = rank
        self.world_size = world_size
        self._agree = agree_group
        self._transport_for = transport_for
        self.credit_bytes = credit_bytes
        self.min_in_flight = MIN_IN_FLIGHT  # ops launched whatever the credit (benchmarks vary it)
        self.timeout_s = timeout_s
        self._name = name
        self._cv = threading.Condition()  # an RLock: a callback may run inline in its issuer
        # The executor waits on a condition of its own (same lock): a completion notifies
        # begin()'s waiters, and waking the idle executor for it cost a GIL hand-off each.
        self._exec_cv = threading.Condition(self._cv)
        # --- this step (reset by begin) ---
        self._step = 0
        self._num_keys = 0
        self._need = False  # agreed: this step's keys are not all agreed ready yet
        self._priorities: list[int] | None = None  # per key, declared by begin() (optional)
        self._outstanding: set[int] = set()  # declared, not launched yet
        self._submitted: dict[int, KeyedOp] = {}  # ready here, not agreed yet
        self._agreed: set[int] = set()
        self._pool: list[KeyedOp] = []  # agreed, not launched (waiting for credit)
        # --- rounds, in issue order (never reset) ---
        self._issued = 0
        self._round_out = False  # our latest round is not processed yet (at most one is)
        self._results: dict[int, tuple[torch.Tensor, int, int, int, int]] = {}
        self._next_result = 0
        # --- launch sequence (never reset: in-flight bytes carry across steps) ---
        self._seq_bytes: list[int] = []
        self._seq_done: list[bool] = []
        self._done_here = 0  # prefix of the sequence complete here
        self._done_agreed = 0  # prefix complete on every rank, as of the last round processed
        # --- executor: launches queued behind a multi-stage op, in sequence order ---
        self._queue: collections.deque[KeyedOp] = collections.deque()
        self._busy = False
        self._streams = streams.EngineStreams()  # CUDA: where launches wait for the submitters
        self._closing = False
        self._error: BaseException | None = None
        self.rounds = 0  # rounds issued: the same on every rank once a step's futures completed
        self.launch_log: list[int] = []  # keys in launch order (tests, benchmarks); reset by begin
        self._thread = threading.Thread(target=self._executor, name=f"{name}-scheduler",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ user side
    def begin(self, num_keys: int, priorities: list[int] | None = None) -> None:
        """Declare this step's keys 0..num_keys-1 (the same on every rank).

        priorities: each key's priority (lower goes first), when known in advance (the same on
        every rank). Then the credit holds an agreed op back only while a key that is not agreed
        yet has a better priority (it could still overtake); without them, whenever the credit
        is spent. In FIFO order no later key can overtake, so nothing is ever held.
        """
        if not 0 < num_keys <= MAX_KEYS:
            raise ValueError(f"gradientflow scheduler: {num_keys} partitions declared; "
                             f"valid range [1, {MAX_KEYS}]: use larger partitions")
        if priorities is not None and len(priorities) != num_keys:
            raise ValueError(f"gradientflow scheduler: {len(priorities)} priorities for "
                             f"{num_keys} partitions; give one per partition (or None)")
        with self._cv:
            self._raise_if_broken()
            if self._outstanding:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: a new step's partitions were declared "
                    f"while keys {sorted(self._outstanding)[:8]} of the previous step were never "
                    "submitted: every partition must be submitted each step (did a parameter "
                    "get no gradient?)")
            # The previous step's rounds must all be issued first (they count its completions).
            deadline = time.monotonic() + self.timeout_s
            while self._done_here < len(self._seq_done) and self._error is None:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(
                        f"gradientflow: rank {self.rank}: the previous step's gradient "
                        f"transfers did not complete within {self.timeout_s:.0f} s; wait for "
                        "every partition's future before the next step's begin()")
            self._raise_if_broken()
            self._step += 1
            self._num_keys = num_keys
            self._priorities = None if priorities is None else list(priorities)
            self._need = True
            self._outstanding = set(range(num_keys))
            self._agreed = set()
            self.launch_log = []

    def submit(self, key: int, priority: int, gen: StageGen, device: torch.device,
               nbytes: int, single_stage: bool = False) -> torch.futures.Future:
        """Mark `key` ready locally; its op is launched once every rank has it ready (by priority).

        single_stage=True: `gen` yields exactly one tensor; it is primed here, on the caller's
        thread (packing overlaps with the caller's work), and its one allreduce runs
        asynchronously on the transport. Otherwise its stages run on the scheduler's thread.
        """
        fut, public = completion.new_future(streams.future_devices(device))
        first = next(gen) if single_stage else None  # pack now, on backward's thread
        self._mark_ready(KeyedOp(key, priority, gen, device, nbytes, fut, first, self._step,
                                 ready=streams.mark(device)))
        return public

    def _mark_ready(self, op: KeyedOp) -> None:
        """Record `op` as ready here and issue the step's next round if it is due."""
        with self._cv:
            self._raise_if_broken()
            key = op.key
            if key not in self._outstanding or key in self._submitted or key in self._agreed:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: partition {key} submitted twice or not "
                    "declared for this step (call begin() once per step, submit each key once)")
            op.step = self._step
            self._submitted[key] = op
            issued = self._maybe_issue()
        self._attach(issued)
        STATS.record_operation()

    def submit_tensor(self, key: int, priority: int, tensor: torch.Tensor,
                      nbytes: int | None = None) -> torch.futures.Future:
        """Mark `key` ready locally with one tensor to SUM-allreduce in place (already packed).

        The lightest path, for the DistributedOptimizer's dense partitions: the returned future
        is completed with `tensor` (summed over ranks) on the transport's thread, with no
        generator to resume there and no hand-off to a completion pool, so whatever follows
        (unpacking) runs on the thread that waits. Its callbacks therefore run on the
        transport's thread and must not block; wait() on it is the intended use.
        """
        # On CUDA the future records the transport's stream at completion and wait() makes the
        # waiter's current stream wait for it (the unpack runs on the waiter's stream).
        fut = (torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda"
               else torch.futures.Future())
        nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        self._mark_ready(KeyedOp(key, priority, None, tensor.device, nbytes, fut, tensor,
                                 self._step, ready=streams.mark(tensor.device)))
        return fut

    def pending(self) -> int:
        """Keys declared this step and not launched yet."""
        with self._cv:
            return len(self._outstanding)

    def set_credit(self, credit_bytes: int) -> None:
        """Use `credit_bytes` from the next step on; only between steps (nothing declared or
        waiting for credit), at the same step on every rank, since launches follow from it."""
        with self._cv:
            if self._outstanding or self._pool:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: the scheduler's credit of process group "
                    f"{self._name} was changed with {len(self._outstanding)} key(s) of this "
                    "step not launched; change it between steps")
            self.credit_bytes = credit_bytes

    def close(self) -> None:
        """Fail what is still waiting and stop the thread."""
        with self._cv:
            self._closing = True
            err = RuntimeError(f"gradientflow: rank {self.rank}: process group {self._name} was "
                               "destroyed while gradient partitions were still scheduled")
            self._fail_waiting(err)
            self._cv.notify_all()
            self._exec_cv.notify_all()
        self._thread.join(5.0)

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"gradientflow: rank {self.rank}: the scheduler of process group "
                               f"{self._name} failed earlier: {self._error}") from self._error
        if self._closing:
            raise RuntimeError(f"gradientflow: rank {self.rank}: process group {self._name} "
                               "was destroyed")

    def _fail_waiting(self, err: BaseException) -> None:
        """Fail every op not launched yet (caller holds the lock)."""
        for op in list(self._submitted.values()) + self._pool + list(self._queue):
            completion.complete(op.fut, error=err)
        self._submitted.clear()
        self._pool.clear()
        self._queue.clear()
        self._outstanding.clear()

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._fail_waiting(exc)
            self._cv.notify_all()

    # ------------------------------------------------------------------ rounds
    def _news(self) -> bool:
        """Whether this rank knows something the last processed round did not agree (lock held):
        a key ready here but not everywhere, or a completion that could free held credit."""
        return bool(self._submitted) or (bool(self._pool)
                                         and self._done_here > self._done_agreed)

    def _maybe_issue(self):
        """Issue the step's next round if it is due and this rank has news for it (lock held).

        A round is due while the agreed state says this step's keys are not all agreed ready
        (`_need`, the same on every rank after the same rounds), and only once this rank has
        processed its previous round. Every rank therefore issues the same rounds: each issues
        round i+1 iff round i left keys unagreed, and does so as soon as it has news (at the
        latest when its last key is submitted), whatever its timing.
        """
        if (self._round_out or not self._need or self._closing or self._error is not None
                or not self._news()):
            return None
        n = self._num_keys
        # Counts relative to what the rounds so far agreed complete, within the launches not
        # agreed complete yet: both the same on every rank here, since a rank issues round i+1
        # only once it processed rounds 0..i.
        base = self._done_agreed
        span = len(self._seq_bytes) - base
        words = round_bits(n, [*self._submitted, *self._agreed], self._done_here - base, span)
        # One tensor op: every torch call here releases the GIL, and getting it back behind the
        # transport's threads is what a round costs backward's thread.
        vec = torch.tensor(words, dtype=torch.int64)
        index = self._issued
        self._issued += 1
        self.rounds = self._issued
        self._round_out = True
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.BAND
        # Issued under the lock: rounds enter the agreement group in index order.
        work = self._agree.allreduce([vec], opts)
        return work, index, (vec, n, span, base, self._step), time.perf_counter()

    def _attach(self, issued) -> None:
        """Process the round's result when it completes (outside the lock: it may run inline)."""
        if issued is not None:
            work, index, state, t0 = issued
            work.get_future().add_done_callback(
                lambda f: self._on_round(index, state, t0, f))

    def _on_round(self, index: int, state: tuple, t0: float, f: torch.futures.Future) -> None:
        """A round completed (agreement group's thread): decide, in round order, and launch."""
        try:
            f.wait()
            dt = time.perf_counter() - t0
            STATS.record_agreement(dt)
            if TIMELINE.enabled:
                TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6,
                                  tid="scheduler", args={"round": index})
            with self._cv:
                self._results[index] = state
                while self._next_result in self._results:
                    self._decide(*self._results.pop(self._next_result))
                    self._next_result += 1
                self._round_out = False
                # Whatever became ready here while this round was in flight goes into the next.
                issued = self._maybe_issue()
                if self._busy or any(op.first is None for op in self._queue):
                    self._exec_cv.notify()  # the executor keeps the sequence
                else:
                    # Only single-stage launches and the executor idle: issue them here (a
                    # thread hand-off less), under the lock, so they keep the sequence order.
                    while self._queue:
                        self._launch_async(self._queue.popleft())
            self._attach(issued)
        except BaseException as exc:  # noqa: BLE001 - fail loudly, never hang
            self._fail(exc)

    def _decide(self, vec: torch.Tensor, n: int, span: int, base: int, step: int) -> None:
        """Pool the newly agreed keys; queue launches within the credit (agreed state only)."""
        ready, done = read_bits(vec.tolist(), n, span)
        self._done_agreed = max(self._done_agreed, base + done)
        if step != self._step:
            return  # a finished step's completion round: only its completion count matters
        for key in range(n):
            if ready >> key & 1 and key not in self._agreed:
                self._agreed.add(key)
                self._pool.append(self._submitted.pop(key))
        self._pool.sort(key=lambda o: (o.priority, o.key))
        # Bytes launched and not agreed complete: the same number on every rank.
        in_flight = sum(self._seq_bytes[self._done_agreed:])
        ops_in_flight = len(self._seq_bytes) - self._done_agreed
        last = len(self._agreed) == n  # nothing can arrive any more: launch all, in order
        self._need = not last  # the same on every rank: the step's last round is this one
        # The best priority that may still arrive (a key not agreed yet): holding an op back
        # for credit only helps if such a key could overtake it. Agreed state and static
        # priorities only, so the same on every rank.
        if self._priorities is None or last:
            best_unagreed = -math.inf
        else:
            best_unagreed = min(self._priorities[k] for k in range(n) if k not in self._agreed)
        while self._pool:
            op = self._pool[0]
            if (not last and ops_in_flight >= self.min_in_flight
                    and in_flight + op.nbytes > self.credit_bytes
                    and best_unagreed < op.priority):
                break
            self._pool.pop(0)
            self._outstanding.discard(op.key)
            op.seq = len(self._seq_bytes)
            self._seq_bytes.append(op.nbytes)
            self._seq_done.append(False)
            in_flight += op.nbytes
            ops_in_flight += 1
            self._queue.append(op)
            self.launch_log.append(op.key)

    # ------------------------------------------------------------------ launches
    def _executor(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._queue:
                    self._exec_cv.wait()
                if self._closing:
                    return
                self._busy = True
                ops = list(self._queue)
                self._queue.clear()
            try:
                for op in ops:
                    if op.first is not None:
                        with self._cv:
                            self._launch_async(op)
                    else:
                        self._run_sync(op)
            except BaseException as exc:  # noqa: BLE001 - fail loudly, never hang
                self._fail(exc)
            finally:
                with self._cv:
                    self._busy = False

    def _mark_done(self, op: KeyedOp) -> None:
        """Count a completion here and issue its round (before the op's future completes)."""
        issued = None
        with self._cv:
            self._seq_done[op.seq] = True
            while self._done_here < len(self._seq_done) and self._seq_done[self._done_here]:
                self._done_here += 1
            if op.step == self._step:
                issued = self._maybe_issue()  # only while held credit waits for this news
            self._cv.notify_all()  # begin() may wait for the previous step's completions
        self._attach(issued)

    def _record(self, op: KeyedOp, tensor: torch.Tensor, t0: float) -> None:
        dt = time.perf_counter() - t0
        STATS.record_message(1, tensor.numel() * tensor.element_size(), 0, dt)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.ALLREDUCE, tl.CAT_COMM, now_us() - dt * 1e6, dt * 1e6,
                              tid=f"partition {op.key}",
                              args={"key": op.key, "priority": op.priority, "seq": op.seq})

    def _launch_async(self, op: KeyedOp) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        tensor, op.first = op.first, None
        op.t_launch = time.perf_counter()
        # CUDA: the transport orders itself after this thread's current stream, which must
        # first wait for the submitter's (streams.py); the callback below runs on a stream that
        # waited for the transport.
        with self._streams.after(op.device, [op.ready]):
            work = self._transport_for(op.device).allreduce([tensor], opts)
        work.get_future().add_done_callback(
            lambda f, op=op, tensor=tensor: self._on_complete(op, tensor, f))

    def _on_complete(self, op: KeyedOp, tensor: torch.Tensor, f: torch.futures.Future) -> None:
        """Transport callback of a single-stage op: unpack, count it, complete its future."""
        value, error = None, None
        if op.gen is None:  # submit_tensor: nothing to run here, complete inline
            try:
                f.value()  # raises the transport's error, if any
                self._record(op, tensor, op.t_launch)
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                error = exc
                self._fail(exc)
            self._mark_done(op)
            try:
                if error is not None:
                    op.fut.set_exception(error)
                else:
                    op.fut.set_result(tensor)
            except RuntimeError:
                pass  # already failed by close() or an earlier error
            return
        try:
            f.wait()  # raises the transport's error, if any
            self._record(op, tensor, op.t_launch)
            try:
                op.gen.send(tensor)
            except StopIteration as stop:
                value = stop.value
            else:
                raise RuntimeError(f"gradientflow: rank {self.rank}: partition {op.key} was "
                                   "submitted as single-stage but yielded a second tensor; "
                                   "submit it with single_stage=False")
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            error = exc
            self._fail(exc)
        # Counted (and its round issued) before the caller can see the future complete.
        self._mark_done(op)
        completion.complete(op.fut, value, error, stream=streams.current(op.device))

    def _run_sync(self, op: KeyedOp) -> None:
        """Every stage of a multi-stage op, back to back on this thread (the sequence is fixed)."""
        with self._streams.after(op.device, [op.ready]) as stream:
            self._stages_on(op, stream)

    def _stages_on(self, op: KeyedOp, stream: Any) -> None:
        """_run_sync's body, with `stream` (CUDA: the scheduler's) current."""
        transport = self._transport_for(op.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            tensor = next(op.gen)
            while True:
                t1 = time.perf_counter()
                transport.allreduce([tensor], opts).wait()
                self._record(op, tensor, t1)
                tensor = op.gen.send(tensor)
        except StopIteration as stop:
            self._mark_done(op)
            completion.complete(op.fut, stop.value, stream=stream)
        except BaseException as exc:
            self._mark_done(op)
            completion.complete(op.fut, error=exc)
            raise
