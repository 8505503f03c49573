"""Keyed scheduling: launch gradient partitions in priority order among those ready on EVERY rank.

The DistributedOptimizer's partitions become ready during backward in timing-dependent order,
which differs between ranks. Launching "the most urgent ready partition" from local state would
pair different partitions across ranks. So launch decisions come from agreement rounds: every rank
contributes a 0/1 vector of its locally ready keys (and how much of the launch sequence it has
seen complete), MIN over ranks is what holds everywhere, and the launch order is a pure function
of that agreed state and the static priorities (TicTac's order: the partition the next forward
pass needs first goes first). A credit bounds the agreed bytes in flight, so a newly ready
first-layer partition is not stuck behind many queued late ones (ByteScheduler's credit).

What is decided by the call sequence, and what by local time:

- The launch sequence on the transport (which gloo/NCCL pairs by issue order) is a function of
  agreed state only: the agreed ready set, the agreed completion count and the priorities. Rounds
  are numbered alike on every rank, so after round j every rank holds the same agreed state and
  launches the same partitions in the same order, asynchronously (the transport runs them).
- WHETHER a round j+1 happens is also decided by agreed state: it happens iff, after round j,
  some declared key is not agreed yet or agreed partitions wait for credit. Every rank knows
  this at the same round, so ranks never disagree on the number of rounds.
- WHEN a rank enters round j+1 is local: once it has something the agreement does not reflect
  yet (a key ready here but not agreed, or, while partitions wait for credit, more of the launch
  sequence completed here than agreed). No polling: a rank with nothing new sleeps on a
  condition until its backward (or step()) marks a key ready or a transfer completes; its peers
  meanwhile block in round j+1's allreduce, which is exactly the wait for the slowest rank
  that any agreement needs. Every rank eventually has something new (all keys get submitted
  every step; a partition in flight eventually completes), so every round is eventually entered
  by every rank and rounds pair without timers.

Single-stage ops (the dense average: pack, SUM-allreduce, unpack) are primed by submit() on the
caller's thread (backward's hook thread packs the flat buffer as soon as the partition is complete)
and launched asynchronously; the transport's completion callback unpacks them. Multi-stage ops
(compressed or sparse) run their stages back to back on the scheduler thread when launched, so
their later stages, too, enter the transport at a point of the sequence that is the same on every
rank.

Why a stream of its own (its own agreement group, its own transport group, its own thread):
rounds of the sequence engine are positioned by the call sequence (one per batch of deferred
allreduces), but keyed rounds are positioned by readiness (a rank whose partitions are not ready
yet must still answer). Sharing one thread would let rank 0 block in a keyed round while rank 1
blocks in a sequenced collective waiting for rank 0: a deadlock. Two independent ordered
streams cannot wait on each other, and each is consistent across ranks on its own.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.engine import completion
from gradientflow.engine.stages import StageGen
from gradientflow.observability import timeline as tl
from gradientflow.observability.stats import STATS
from gradientflow.observability.timeline import TIMELINE, now_us

MAX_KEYS = 1024  # most partitions one step may declare (the round carries one slot per key)
# Ops kept in flight whatever the credit: measured on loopback gloo (2 ranks, 8 x 4 MiB), two in
# flight took 51 ms, one at a time 81 ms (the transport idles while the next is issued) and all
# at once 70 ms (they compete for gloo's two worker threads and the cores). With two, the round
# that frees credit overlaps the other transfer.
MIN_IN_FLIGHT = 2


@dataclass
class KeyedOp:
    """One partition's op, waiting for its key to be agreed ready everywhere."""

    key: int
    priority: int
    gen: StageGen
    device: torch.device
    nbytes: int
    fut: torch.futures.Future
    first: torch.Tensor | None = None  # single-stage ops: the packed tensor, primed at submit
    seq: int = -1  # position in the launch sequence (the same on every rank)
    t_launch: float = field(default=0.0)


class KeyedScheduler:
    """Agrees on ready keys with the other ranks and launches their ops in priority order."""

    def __init__(self, rank: int, world_size: int, agree_group: Any,
                 transport_for: Callable[[torch.device], Any], credit_bytes: int,
                 poll_ms: float, timeout_s: float, name: str = "gradientflow") -> None:
        # poll_ms is accepted for the Config field but unused: rounds are event-driven.
        self.rank = rank
        self.world_size = world_size
        self._agree = agree_group
        self._transport_for = transport_for
        self.credit_bytes = credit_bytes
        self.timeout_s = timeout_s
        self._name = name
        self._cv = threading.Condition()
        self._num_keys = 0  # declared this step (0: no step open)
        self._outstanding: set[int] = set()  # declared this step, not launched yet
        self._ready: dict[int, KeyedOp] = {}  # ready here, not agreed yet
        self._agreed: set[int] = set()  # agreed this step (launched or in the pool)
        self._pool: list[KeyedOp] = []  # agreed, not launched (waiting for credit)
        # Launch sequence (never reset, so in-flight bytes carry across steps): the bytes of
        # each launched op, whether it completed here, the prefix completed here, and the
        # prefix agreed complete everywhere.
        self._seq_bytes: list[int] = []
        self._seq_done: list[bool] = []
        self._done_here = 0
        self._done_agreed = 0
        self._closing = False
        self._error: BaseException | None = None
        self.rounds = 0
        self.launch_log: list[int] = []  # keys in launch order (tests, benchmarks); reset by begin
        self._thread = threading.Thread(target=self._main, name=f"{name}-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ user side
    def begin(self, num_keys: int) -> None:
        """Declare this step's keys 0..num_keys-1 (the same on every rank)."""
        if not 0 < num_keys <= MAX_KEYS:
            raise ValueError(f"gradientflow scheduler: {num_keys} partitions declared; "
                             f"valid range [1, {MAX_KEYS}]: use larger partitions")
        with self._cv:
            self._raise_if_broken()
            if self._outstanding:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: a new step's partitions were declared "
                    f"while keys {sorted(self._outstanding)[:8]} of the previous step were never "
                    "submitted: every partition must be submitted each step (did a parameter "
                    "get no gradient?)")
            self._num_keys = num_keys
            self._outstanding = set(range(num_keys))
            self._agreed = set()
            self.launch_log = []
            self._cv.notify_all()

    def submit(self, key: int, priority: int, gen: StageGen, device: torch.device,
               nbytes: int, single_stage: bool = False) -> torch.futures.Future:
        """Mark `key` ready locally; its op is launched once every rank has it ready (by priority).

        single_stage=True: `gen` yields exactly one tensor; it is primed here, on the caller's
        thread (packing overlaps with the caller's work), and its one allreduce runs
        asynchronously on the transport. Otherwise every stage runs on the scheduler thread.
        """
        fut, public = completion.new_future()
        first = None
        if single_stage:
            first = next(gen)  # pack now, on the caller's (backward's) thread
        with self._cv:
            self._raise_if_broken()
            if key not in self._outstanding or key in self._ready or key in self._agreed:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: partition {key} submitted twice or not "
                    "declared for this step (call begin() once per step, submit each key once)")
            self._ready[key] = KeyedOp(key, priority, gen, device, nbytes, fut, first)
            self._cv.notify_all()
        STATS.record_operation()
        return public

    def pending(self) -> int:
        """Keys declared this step and not launched yet."""
        with self._cv:
            return len(self._outstanding)

    def close(self) -> None:
        """Fail what is still waiting and stop the thread."""
        with self._cv:
            self._closing = True
            err = RuntimeError(f"gradientflow: rank {self.rank}: process group {self._name} was "
                               "destroyed while gradient partitions were still scheduled")
            self._fail_waiting(err)
            self._cv.notify_all()
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
        for op in list(self._ready.values()) + self._pool:
            completion.complete(op.fut, error=err)
        self._ready.clear()
        self._pool.clear()
        self._outstanding.clear()

    # ------------------------------------------------------------------ scheduler thread
    def _round_needed(self) -> bool:
        """Agreed state says another round comes (the same answer on every rank)."""
        return bool(self._pool) or len(self._agreed) < self._num_keys

    def _something_new(self) -> bool:
        """This rank knows something the agreement does not reflect yet."""
        if self._ready:
            return True
        return bool(self._pool) and self._done_here > self._done_agreed

    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not (self._round_needed() and self._something_new()):
                    self._cv.wait()
                if self._closing:
                    return
                n = self._num_keys
                vec = torch.zeros(n + 1, dtype=torch.int64)
                for key in self._ready:
                    vec[key] = 1
                for key in self._agreed:
                    vec[key] = 1
                vec[n] = self._done_here
            try:
                self._round(vec)
                self._after_round(vec)
            except BaseException as exc:  # noqa: BLE001 - fail loudly, never hang
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._fail_waiting(exc)
            self._cv.notify_all()

    def _round(self, vec: torch.Tensor) -> None:
        t0 = time.perf_counter()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self._agree.allreduce([vec], opts).wait()
        dt = time.perf_counter() - t0
        self.rounds += 1
        STATS.record_agreement(dt)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6,
                              tid="scheduler")

    def _after_round(self, vec: torch.Tensor) -> None:
        """Move newly agreed keys into the pool and launch within the credit (agreed state only)."""
        n = self._num_keys
        agreed = torch.nonzero(vec[:n]).flatten().tolist()
        with self._cv:
            self._done_agreed = max(self._done_agreed, int(vec[n]))
            for key in agreed:
                if key not in self._agreed:
                    self._agreed.add(key)
                    self._pool.append(self._ready.pop(key))
            self._pool.sort(key=lambda o: (o.priority, o.key))
            # Bytes launched and not agreed complete: the same number on every rank.
            in_flight = sum(self._seq_bytes[self._done_agreed:])
            ops_in_flight = len(self._seq_bytes) - self._done_agreed
            launch = []
            while self._pool:
                op = self._pool[0]
                if (ops_in_flight >= MIN_IN_FLIGHT
                        and in_flight + op.nbytes > self.credit_bytes):
                    break
                ops_in_flight += 1
                self._pool.pop(0)
                self._outstanding.discard(op.key)
                op.seq = len(self._seq_bytes)
                self._seq_bytes.append(op.nbytes)
                self._seq_done.append(False)
                in_flight += op.nbytes
                launch.append(op)
                self.launch_log.append(op.key)
        for op in launch:
            if op.first is not None:
                self._launch_async(op)
            else:
                self._run_sync(op)

    def _mark_done(self, op: KeyedOp) -> None:
        with self._cv:
            self._seq_done[op.seq] = True
            while self._done_here < len(self._seq_done) and self._seq_done[self._done_here]:
                self._done_here += 1
            self._cv.notify_all()

    def _record(self, op: KeyedOp, tensor: torch.Tensor, t0: float) -> None:
        dt = time.perf_counter() - t0
        STATS.record_message(1, tensor.numel() * tensor.element_size(), 0, dt)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.ALLREDUCE, tl.CAT_COMM, now_us() - dt * 1e6, dt * 1e6,
                              tid=f"partition {op.key}",
                              args={"key": op.key, "priority": op.priority, "seq": op.seq})

    def _launch_async(self, op: KeyedOp) -> None:
        transport = self._transport_for(op.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        tensor, op.first = op.first, None
        op.t_launch = time.perf_counter()
        work = transport.allreduce([tensor], opts)
        work.get_future().add_done_callback(
            lambda f, op=op, tensor=tensor: self._on_complete(op, tensor, f))

    def _on_complete(self, op: KeyedOp, tensor: torch.Tensor, f: torch.futures.Future) -> None:
        """Transport callback of a single-stage op: unpack, complete its future, free credit."""
        try:
            f.wait()  # raises the transport's error, if any
            self._record(op, tensor, op.t_launch)
            try:
                op.gen.send(tensor)
            except StopIteration as stop:
                completion.complete(op.fut, stop.value)
            else:
                raise RuntimeError(f"gradientflow: rank {self.rank}: partition {op.key} was "
                                   "submitted as single-stage but yielded a second tensor; "
                                   "submit it with single_stage=False")
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            completion.complete(op.fut, error=exc)
            self._fail(exc)
        finally:
            self._mark_done(op)

    def _run_sync(self, op: KeyedOp) -> None:
        """Every stage of a multi-stage op, back to back on this thread (the sequence is fixed)."""
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
            completion.complete(op.fut, stop.value)
        except BaseException as exc:
            completion.complete(op.fut, error=exc)
            raise
        finally:
            self._mark_done(op)
