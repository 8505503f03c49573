"""The ordered engine: one per gradientflow process group.

Every collective of the group gets a sequence number in issue order (the same on every rank,
because torch.distributed requires every rank to issue the same collectives in the same order).
The engine hands transport operations to the transport (gloo, NCCL) in that order, so nothing
overtakes anything and every rank pairs the same messages.

Lazy allreduce. An async allreduce smaller than the fusion threshold is *deferred*: queued,
and sent later fused with its neighbours. Where a fused message may end cannot be decided
locally: rank 0 may wait on op 3 right after issuing it while rank 1 has issued ops 3-7, so
rank 1 must not fuse 3 with 4 unless every rank has issued 4. Each batch of deferred ops is
therefore closed by one *agreement round* on a side group: every rank contributes its local
frontier (one past the last deferred op it has queued before any other collective), the MIN
is the batch end on every rank. Within the agreed batch the cut into messages is a pure
function of the batch (threshold, per-(device, dtype, op) queues): no further talk.

Which calls pay a round follows from the call sequence alone: exactly one round per batch of
deferred ops, none for a collective that is not deferred (synchronous calls, other
collectives, allreduces at least as large as the threshold) when no deferred op precedes it.
A round is *started* on each rank for a local reason (a wait on a queued op, flush(), the
threshold reached, another collective queued behind the batch, or the transport falling idle),
but the rounds themselves pair one-to-one across ranks because every rank closes the same
batches. See docs/DESIGN.md for why threshold cuts alone cannot skip the round.

The solo channel (CPU). An allreduce of at least the solo threshold is sent alone anyway; on
CPU it goes at once, on the caller's thread, over a transport of its own (a second gloo group),
where the issue order is the agreed order. It overtakes the deferred batch before it, which is
safe because the two transports never pair each other's messages (on_solo_channel says why no
rank can wait for the other's solo), and it leaves during the issuing loop instead of after it.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.algorithms.base import StepFailed
from gradientflow.config import Config
from gradientflow.engine import completion, streams
from gradientflow.engine.fusion import (FusableOp, Message, SegmentPool, pack, plan_messages,
                                        solo_cut, unpack)
from gradientflow.engine.stages import StageGen
from gradientflow.engine.work import FusedWork, FutureWork
from gradientflow.observability import timeline as tl
from gradientflow.observability.stats import STATS
from gradientflow.observability.timeline import TIMELINE, now_us


MAX_BATCH = 256  # most deferred ops one agreement round can close
MAX_WAIT_CYCLES = 5  # longest a partial batch waits for a quiet caller, in cycle times
BUSY_QUIET_CYCLES = 5  # how long a caller must be quiet while the transport is busy, in cycles
_MASK = 2**61 - 1
_FP_BITS = 40  # the round's words: (ops << 40) | 40-bit fingerprint (MAX_BATCH fits 9 bits)
_FP_MASK = (1 << _FP_BITS) - 1


def _mix(h: int, x: int) -> int:
    """Fold fingerprint x into running fingerprint h (deterministic across processes)."""
    return ((h * 1_000_003) ^ x) & _MASK


def batch_fingerprint(ops: list[FusableOp]) -> int:
    """The fingerprint of a batch's ops (dtype, size, reduce op), chained from its first
    sequence number, so ranks whose batches start at different operations differ too."""
    h = ops[0].seq
    for op in ops:
        h = _mix(h, op.fingerprint)
    return h


def round_words(k: int, fingerprint: int) -> list[int]:
    """A rank's two words for the agreement round: k candidates, their fingerprint."""
    f = fingerprint & _FP_MASK
    return [(k << _FP_BITS) | f, ((MAX_BATCH - k) << _FP_BITS) | (_FP_MASK - f)]


def read_round(a: int, b: int) -> tuple[int, int, int, int]:
    """The MIN-allreduced round words as (smallest k, largest k, lo, hi): lo is the smallest
    fingerprint among the ranks at the smallest k, hi the largest among those at the largest
    k (so, when every rank has the same k, the smallest and largest of all)."""
    return (a >> _FP_BITS, MAX_BATCH - (b >> _FP_BITS), a & _FP_MASK,
            _FP_MASK - (b & _FP_MASK))


class EngineError(RuntimeError):
    """The engine can no longer make progress (a peer died, a round timed out, shutdown)."""


@dataclass
class EagerOp:
    """A collective sent as issued, in sequence order: launch() hands it to the transport."""

    seq: int
    name: str
    launch: Callable[[], Any]  # -> c10d Work
    outputs: Any
    fut: torch.futures.Future
    device: torch.device | None = None
    ready: Any = None  # CUDA: streams.mark() of the submitting thread's stream


@dataclass
class StagesOp:
    """A multi-collective op (a compressed bucket): its stages run back to back on the engine."""

    seq: int
    name: str
    gen: StageGen
    device: torch.device
    fut: torch.futures.Future
    key: Hashable = None
    dense_bytes: int = 0  # the dense FP32 size of what the stages carry (for statistics)
    ready: Any = None  # CUDA: streams.mark() of the submitting thread's stream


@dataclass
class _Counters:
    rounds: int = 0
    round_s: float = 0.0
    messages: int = 0
    fused_tensors: int = 0
    deferred: int = 0
    eager: int = 0
    fast_path: int = 0
    solo_channel: int = 0  # allreduces sent at once on the solo channel (CPU)


class Engine:
    """Sequences every collective of one process group onto its transports, fusing allreduces."""

    def __init__(self, rank: int, world_size: int, config: Config, timeout_s: float,
                 transport_for: Callable[[torch.device], Any], agree_group: Any,
                 name: str = "gradientflow") -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.timeout_s = timeout_s
        self._transport_for = transport_for
        self._agree = agree_group
        self._name = name
        # The engine's state lock (reentrant: the backend holds it around a submission), and a
        # condition on it for the engine thread. Hot paths take `_lock` directly: `with` on a
        # Condition enters through a Python-level method, several per op otherwise.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._q: collections.deque = collections.deque()  # issued, not yet agreed/ordered
        # Agreed transport order: fused messages, eager and staged ops, launched strictly in
        # this order. A message waits here (not on the engine thread) for a free segment, so
        # the engine can agree the next batch meanwhile.
        self._launch: collections.deque = collections.deque()
        self._seq = 0  # next sequence number
        self._run_len = 0  # leading deferred ops in _q
        self._run_bytes = 0
        self._run_since = 0.0
        self._last_submit = 0.0  # when the last deferred op was queued (the quiet rule)
        self._wanted_upto = -1  # highest seq somebody waits on (or flushed)
        self._busy = False
        self._inflight = 0  # fused messages handed to the transport, not yet unpacked
        self._closing = False
        self._error: BaseException | None = None
        self._pools: dict[Hashable, SegmentPool] = {}
        self._streams = streams.EngineStreams()  # CUDA: where this thread packs and unpacks
        # CPU: fused messages in flight, in launch order, for the reaper thread (_reap_main).
        self._reap: collections.deque = collections.deque()
        self._reap_cv = threading.Condition()
        # Guards a CPU fused op's done / fut / chained between its Work (future_of) and the
        # reaper (_finish_ops): either the reaper sees the future, or future_of sees the op done
        # (and settles the future it makes itself).
        self._chain_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self.counters = _Counters()
        # Allreduces of at least this many bytes go alone (plan_messages' cut); on CPU with
        # the solo channel on, at once (on_solo_channel, submit_solo).
        self.solo_bytes = solo_cut(config.fusion_threshold, config.solo_threshold)
        self._solo_channel = config.solo_channel and config.fusion_threshold > 0
        self._solo_last: Any = None  # the solo channel's last Work (still in flight?)
        # Set by the backend: turns a transport error into the inspector's explanation (which
        # rank is missing or died, what differed). Called once, on the first error only.
        self.explain: Callable[[BaseException], BaseException] | None = None
        self._thread = threading.Thread(target=self._main, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def describe(self, seq: int, name: str) -> str:
        return f"rank {self.rank}: {name} (sequence number {seq}) on process group {self._name}"

    def check_not_engine_thread(self, describe: Callable[[], str]) -> None:
        """Refuse a blocking wait on the engine's own thread: it would wait on itself forever.

        `describe` names the op; it is called only for the error (every wait() passes here).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"gradientflow: {describe()}: wait() called on the engine thread, which is the "
                "thread that must complete it (a deadlock). Chain work with Future.then() "
                "instead of waiting inside a stage."
            )

    def _check_usable(self, what: str) -> None:
        if self._error is not None:
            raise EngineError(
                f"gradientflow: rank {self.rank}: cannot run {what}: the process group "
                f"{self._name} failed earlier and is unusable ({self._error}). Destroy it and "
                "create a new one (or restart the job from a checkpoint)."
            ) from self._error
        if self._closing:
            raise EngineError(
                f"gradientflow: rank {self.rank}: cannot run {what}: the process group "
                f"{self._name} was destroyed. Create a new process group first."
            )

    def fusable(self, nbytes: int, async_op: bool = True) -> bool:
        """Whether an allreduce of `nbytes` bytes is deferred for fusion (same on every rank).

        Async allreduces below the fusion threshold are deferred. Synchronous ones are deferred
        too below `sync_fusion_limit`: PyTorch itself pairs a synchronous allreduce on one rank
        with an asynchronous one on another (Join: a joined rank's `all_reduce(zeros(1))`
        answers the others' `all_reduce(ones(1), async_op=True)`), so for small tensors the
        decision must not depend on async_op. Larger synchronous ones go eagerly, paying no
        round (they must then be synchronous on every rank).
        """
        thr = self.config.fusion_threshold
        limit = thr if async_op else min(thr, self.config.sync_fusion_limit)
        return nbytes < limit

    def on_solo_channel(self, device: torch.device, nbytes: int) -> bool:
        """Whether an allreduce of `nbytes` bytes on `device` goes at once on the solo channel
        (the same on every rank: it depends on the call alone, not on async_op).

        A solo tensor is sent alone anyway (plan_messages); what the round would add is only
        its place among the fused messages of its batch. On a transport of its own, in issue
        order, it needs no place there: every rank sends the same solos in the same order, and
        a rank blocked in a wait on an earlier deferred op still takes part in that op's round
        (the engine thread runs it), so no rank waits for a solo that another cannot send.
        """
        return self._solo_channel and device.type == "cpu" and nbytes >= self.solo_bytes

    def submit_solo(self, launch: Callable[[], Any], tensor: torch.Tensor) -> Any:
        """Send a solo allreduce now, on the caller's thread: `launch()` hands it to the solo
        channel's transport and returns that Work. It takes its sequence number like every
        collective (the inspector's records stay in issue order) but overtakes the deferred
        batch before it, which travels on the main transport."""
        with self._lock:
            self._check_usable("allreduce")
            self._seq += 1
            self.counters.solo_channel += 1
            self.counters.messages += 1
            work = launch()
            # The caller is not quiet, and the transport is not idle (_should_round): a
            # per-tensor loop that sends solos between its small tensors is still issuing.
            self._last_submit = time.monotonic()
            self._solo_last = work
        STATS.record_operation()
        numel = tensor.numel()
        STATS.record_message(1, numel * tensor.element_size(), numel * 4)  # time: not seen
        return work

    def submit_allreduce(self, tensor: torch.Tensor, reduce_op: Any,
                         waited: bool = False) -> FusedWork:
        """Queue an allreduce for fusion; returns its Work at once.

        `waited`: the caller waits on it right away (a synchronous call), so its batch is
        agreed at once instead of after the cycle time.
        """
        dev = tensor.device
        if dev.type == "cuda":
            fut = completion.new_source(streams.future_devices(dev))
            ready = streams.mark(dev)
        else:  # no future until somebody blocks or asks for one (FusableOp, future_of)
            fut = ready = None
        with self._lock:
            self._check_usable("allreduce")
            seq = self._seq
            self._seq += 1
            # hash() of a ReduceOp or RedOpType is its op number (cheaper than reading .op).
            op = FusableOp(seq, tensor, (dev, tensor.dtype, hash(reduce_op)), reduce_op, fut,
                           ready)
            if self._run_len == len(self._q):
                if self._run_len == 0:
                    self._run_since = time.monotonic()
                self._run_len += 1
                self._run_bytes += op.nbytes
            self._q.append(op)
            self._last_submit = time.monotonic()
            self.counters.deferred += 1
            if waited:
                self._wanted_upto = max(self._wanted_upto, seq)
            # Wake the engine only when this op changes its decision: a timed wait (the cycle
            # time) re-reads _last_submit when it ends anyway, and a wake-up per op costs the
            # issuing thread a GIL hand-off (a per-tensor loop issues one every few us).
            thr = self.config.fusion_threshold
            crossed = self._run_bytes >= thr > self._run_bytes - op.nbytes
            if (len(self._q) == 1 or waited or self._run_len < len(self._q)
                    or self._run_bytes >= thr):
                self._cv.notify_all()
        STATS.record_operation()
        if TIMELINE.enabled:
            op.queued_us = now_us()
        if crossed:
            # A full message is queued: let the engine have the GIL now to agree and send it.
            # A caller in a tight loop of submissions would otherwise keep the GIL for up to
            # Python's switch interval (5 ms), and the first message of a list would leave
            # only when the loop ends (measured: ~6 ms into a 161-tensor list). With the
            # yield, fused / 25 MB buckets went from 1.27-1.33 to 1.17-1.20 (2 ranks,
            # ResNet-50 list, busy machine, same runs alternated).
            time.sleep(0)
        return FusedWork(op, self)

    def submit_eager(self, name: str, launch: Callable[[], Any], outputs: Any,
                     device: torch.device | None = None) -> Any:
        """Run a collective in sequence order; returns a Work.

        When nothing is queued or running, the transport call is made right here on the
        caller's thread (no hand-off, no round): this is what keeps synchronous collectives
        as fast as plain gloo. Otherwise it queues behind what was issued before it.
        `device`: where its tensors live (CUDA: ordered with this thread's stream).
        """
        with self._cv:
            self._check_usable(name)
            seq = self._seq
            self._seq += 1
            if not self._q and not self._launch and not self._busy:
                self.counters.fast_path += 1
                self.counters.eager += 1
                STATS.record_operation()
                return launch()
            dev = device if device is not None else torch.device("cpu")
            fut = completion.new_source(streams.future_devices(dev))
            self._q.append(EagerOp(seq, name, launch, outputs, fut, dev, streams.mark(dev)))
            self.counters.eager += 1
            self._cv.notify_all()
        STATS.record_operation()
        return FutureWork(fut, self, seq, name)

    def submit_stages(self, name: str, gen: StageGen, device: torch.device,
                      key: Hashable = None, dense_bytes: int = 0) -> torch.futures.Future:
        """Run a multi-stage op (a compressed bucket) in sequence order on the engine thread."""
        fut, public = completion.new_future(streams.future_devices(device))
        ready = streams.mark(device)
        with self._cv:
            self._check_usable(name)
            seq = self._seq
            self._seq += 1
            self._q.append(StagesOp(seq, name, gen, device, fut, key, dense_bytes, ready))
            self._cv.notify_all()
        STATS.record_operation()
        return public

    def want(self, seq: int) -> None:
        """Somebody waits on op `seq`: close its batch soon (a local hint; results never change)."""
        with self._cv:
            if seq > self._wanted_upto:
                self._wanted_upto = seq
                self._cv.notify_all()

    def flush(self) -> None:
        """Agree on everything queued now (a local hint; it never changes any result)."""
        with self._cv:
            self._wanted_upto = max(self._wanted_upto, self._seq - 1)
            self._cv.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting work; fail what is still queued with a clear error; join the thread."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            err = EngineError(
                f"gradientflow: rank {self.rank}: the process group {self._name} was destroyed "
                "while this operation was still queued; wait on every Work before "
                "destroy_process_group()"
            )
            self._fail_queued(err)
            self._cv.notify_all()
        self._thread.join(timeout_s if timeout_s is not None else 5.0)
        with self._reap_cv:
            self._reap_cv.notify_all()  # it ends once what is in flight is finished
        if self._reaper is not None:
            self._reaper.join(timeout_s if timeout_s is not None else 5.0)

    # ------------------------------------------------------------------ engine thread
    def _recount_run(self) -> None:
        """Recompute the leading run of deferred ops after the head of the queue changed."""
        self._run_len = 0
        self._run_bytes = 0
        for op in self._q:
            if not isinstance(op, FusableOp):
                break
            self._run_len += 1
            self._run_bytes += op.nbytes
        self._run_since = time.monotonic()

    def _should_round(self, now: float) -> tuple[bool, float | None]:
        """Whether to start the agreement round for the leading batch now (local reasons)."""
        if self._run_len < len(self._q):  # another collective is queued behind the batch
            return True, None
        first_seq = self._q[0].seq
        if self._wanted_upto >= first_seq or self._run_bytes >= self.config.fusion_threshold:
            return True, None
        # The cycle time (Horovod's): a partial batch is agreed once the caller has been quiet
        # for one cycle: nothing more is coming soon. While the caller keeps issuing, the
        # batch keeps growing (bigger messages, fewer rounds: a per-tensor loop issues a tensor
        # every ~0.1 ms here, so "one cycle after the first tensor" cut a 24-tensor list into 3
        # rounds), up to MAX_WAIT_CYCLES cycles when the transport (solo channel included) is
        # idle, so latency stays bounded. With messages in flight there is no such bound: the
        # batch grows until the transport needs more, the threshold is reached or the caller
        # pauses, and waiting for the transport to drain first would serialise the tail of a
        # list behind everything in flight. A pause then counts only after BUSY_QUIET_CYCLES
        # cycles: with solos on the wire during the issuing loop, a caller descheduled for a
        # cycle is not a quiet one (ResNet-50's list, 3 ms cycle: 1.4-2.3 rounds per list at 2
        # ranks and 2.2-3.1 at 4 instead of 1, each extra round also a smaller message; with 5
        # quiet cycles 1.0-1.2 and 1.2-1.5, and 1.05x [1.01, 1.09] as fast at 4 ranks, 8
        # launches, 1.05x [0.93, 1.19] at 2; docs/DESIGN.md, Known gaps, Session 10).
        cycle = self.config.cycle_time_ms / 1000.0
        solo = self._solo_last
        if solo is not None and solo.is_completed():
            solo = self._solo_last = None  # (it keeps its tensor alive)
        idle = self._inflight == 0 and solo is None
        left = self._last_submit + (cycle if idle else BUSY_QUIET_CYCLES * cycle) - now
        if idle:
            left = min(left, self._run_since + MAX_WAIT_CYCLES * cycle - now)
        return (left <= 0), (left if left > 0 else None)

    def _next_job(self):
        """The engine's next job, or None to wait (lock held); also the wait's timeout.

        Launching in agreed order comes first: the head of `_launch` goes as soon as it can
        (a message needs a free segment of its queue). Otherwise the head of `_q` is ordered:
        a non-deferred op joins `_launch` behind everything agreed before it; a run of deferred
        ops gets its agreement round when a local reason says so (see `_should_round`).
        """
        if self._launch:
            head = self._launch[0]
            if not isinstance(head, Message) or head.solo:
                return self._launch.popleft(), None
            acquired = self._pool_for(head).try_acquire(head.numel)
            if acquired is not None:
                self._launch.popleft()
                return (head, acquired), None
            # Blocked on a segment: a release wakes us. Rounds may still run meanwhile.
        while self._q and not isinstance(self._q[0], FusableOp):
            self._launch.append(self._q.popleft())
            self._recount_run()
        if self._launch and not isinstance(self._launch[0], Message):
            return self._launch.popleft(), None
        if not self._q:
            return None, None
        go, delay = self._should_round(time.monotonic())
        if go:
            # Snapshot of the local batch candidates, capped so the round's fingerprint
            # vector stays small.
            return ("round", [self._q[i] for i in range(min(self._run_len, MAX_BATCH))]), None
        return None, delay

    def _main(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closing and not self._q and not self._launch:
                        self._busy = False
                        return
                    job, delay = self._next_job()
                    if job is not None:
                        break
                    self._busy = False
                    self._cv.wait(delay)
                self._busy = True
            try:
                if isinstance(job, tuple) and job[0] == "round":
                    self._run_batch(job[1])
                elif isinstance(job, tuple):
                    self._launch_message(job[0], *job[1])
                elif isinstance(job, Message):
                    self._launch_message(job, None, job.ops[0].tensor)
                elif isinstance(job, StagesOp):
                    self._run_stages(job)
                else:
                    self._run_eager(job)
            except BaseException as exc:  # noqa: BLE001 - the engine must fail loudly, not die
                self._fail(exc)
                return

    def abort(self, exc: BaseException) -> None:
        """Fail the group: every queued op raises, later submissions too; the first error stays."""
        self._fail(exc)

    def _fail_queued(self, err: BaseException) -> None:
        """Complete every op not yet handed to the transport with `err` (lock held)."""
        ops = list(self._launch) + list(self._q)
        self._launch.clear()
        self._q.clear()
        fused = []
        for item in ops:
            if isinstance(item, Message):
                fused.extend(item.ops)
            elif isinstance(item, FusableOp):
                fused.append(item)
            else:
                completion.complete(item.fut, error=err)
        self._finish_ops(fused, err)
        self._run_len = self._run_bytes = 0

    def _fail(self, exc: BaseException) -> BaseException:
        """Fail the group with `exc` (explained) unless it failed already; return its error."""
        if self._error is None and self.explain is not None:
            try:
                exc = self.explain(exc)
            except Exception:  # noqa: BLE001 - the original error is still worth raising
                pass
        err = exc if isinstance(exc, EngineError) else EngineError(
            f"gradientflow: rank {self.rank}: process group {self._name} failed: {exc}")
        with self._cv:
            # The first error explains the others (a mismatch, then the timeouts it causes).
            if self._error is None:
                self._error = err
            err = self._error
            self._fail_queued(err)
            self._busy = False
            self._cv.notify_all()
        return err

    def _round(self, candidates: list[FusableOp]) -> tuple[int, tuple[int, int]]:
        """One agreement round: how many of the candidates every rank has queued, and the
        smallest and largest fingerprint of that prefix over the ranks (equal unless the ranks
        queued different allreduces).

        Two int64 words, MIN-allreduced: `(k << 40) | f_k` and `((MAX_BATCH - k) << 40) |
        (2**40 - 1 - f_k)`, where k is this rank's candidate count and f_k the fingerprint of
        its k candidates (their dtype, size and reduce op, chained from the batch's first
        sequence number). The MIN of the first word is the smallest k with the smallest
        fingerprint among the ranks at that k; the second gives the largest k with the largest
        fingerprint. When every rank has the same k (the usual case: the batch is closed by
        waits at the end of a step) that is the whole check. Otherwise a second round
        compares the full fingerprint of the common prefix.

        Why two words instead of a fingerprint per candidate prefix (the first design: 513
        int64): a gloo allreduce of 1-2 elements costs 0.55-0.65 ms at 4 ranks on this 2-core
        machine, of 4 elements 3 ms and of 6 to 513 elements 5-8 ms (its ring then wakes every
        rank several times), while at 2 ranks all of them take 0.3-0.6 ms.
        """
        t0 = time.perf_counter()
        k = len(candidates)
        words = round_words(k, batch_fingerprint(candidates))
        n, n_max, lo, hi = read_round(*self._agree_min(words, candidates[0].seq))
        rounds = 1
        if n != n_max:
            # Frontiers differ: compare the fingerprints of the prefix every rank has (n is
            # the smallest count, so every rank has at least n candidates).
            h = batch_fingerprint(candidates[:n])
            lo, neg = self._agree_min([h, -h], candidates[0].seq)
            hi = -neg
            rounds = 2
        dt = time.perf_counter() - t0
        self.counters.rounds += rounds
        self.counters.round_s += dt
        STATS.record_agreement(dt, rounds)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6, tid="engine",
                              args={"candidates": k, "rounds": rounds})
        return n, (lo, hi)

    def _agree_min(self, words: list[int], first_seq: int) -> tuple[int, int]:
        """MIN-allreduce two int64 words on the agreement group (blocking)."""
        vec = torch.tensor(words, dtype=torch.int64)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        work = self._agree.allreduce([vec], opts)
        try:
            work.wait()
        except Exception as exc:
            raise EngineError(
                f"gradientflow: rank {self.rank}: agreement round for the fused allreduces from "
                f"sequence number {first_seq} failed (a peer may have died or stopped "
                f"issuing the same collectives): {exc}"
            ) from exc
        return int(vec[0]), int(vec[1])

    def _run_batch(self, candidates: list[FusableOp]) -> None:
        n, (lo, hi) = self._round(candidates)
        agreed = candidates[0].seq + n
        if not 1 <= n <= len(candidates):
            raise self._mismatch(candidates, agreed, None)
        if lo != hi:
            raise self._mismatch(candidates[:n], agreed, (lo, hi))
        with self._cv:
            batch = [self._q.popleft() for _ in range(n)]
            self._recount_run()
            self._launch.extend(plan_messages(batch, self.config.fusion_threshold,
                                              self.config.solo_threshold))

    def _mismatch(self, ops: list[FusableOp], agreed: int, fps) -> EngineError:
        """Name what differs: every rank's view of the batch, gathered on the side group."""
        mine = [f"#{op.seq} all_reduce {op.tensor.dtype} {tuple(op.tensor.shape)} "
                f"{op.reduce_op_name}" for op in ops]
        views = None
        try:
            if fps is None:  # not every rank saw this: a gather could hang
                raise LookupError
            import pickle

            data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            self._agree.allgather([sizes], [size]).wait()
            cap = int(max(x.item() for x in sizes))
            padded = torch.zeros(cap, dtype=torch.uint8)
            padded[:data.numel()] = data
            outs = [torch.zeros(cap, dtype=torch.uint8) for _ in range(self.world_size)]
            self._agree.allgather([outs], [padded]).wait()
            views = [pickle.loads(bytes(o[:int(sz.item())].tolist()))
                     for o, sz in zip(outs, sizes)]
        except Exception:  # noqa: BLE001 - the error below is still clear without the views
            pass
        detail = f"fingerprints differ ({fps[0]} vs {fps[1]})" if fps else (
            f"the agreed batch end {agreed} does not fall inside this rank's queued allreduces")
        text = (f"gradientflow: rank {self.rank}: collective mismatch in the async allreduces "
                f"from sequence number {ops[0].seq if ops else '?'}: {detail}. Every rank must "
                "issue the same collectives (op, dtype, shape, reduce op) in the same order; "
                "async allreduces issued from callbacks or threads in timing-dependent order "
                "break that (e.g. powerSGD_hook with several DDP buckets).")
        if views is not None:
            text += "".join(f"\n  rank {r}: {v}" for r, v in enumerate(views))
        return EngineError(text)

    def _pool_for(self, msg: Message) -> SegmentPool:
        pool = self._pools.get(msg.key)
        if pool is None:
            op = msg.ops[0]
            pool = self._pools[msg.key] = SegmentPool(
                op.tensor.dtype, op.tensor.device, self.config.fusion_segments,
                self.config.fusion_threshold // op.tensor.element_size())
        return pool

    def _launch_message(self, msg: Message, seg: int | None, buf: torch.Tensor) -> None:
        """Pack `msg` into its segment `seg` (None: a solo tensor sent in place) and send it.

        CUDA: on the engine's stream, once the callers' streams wrote the tensors (streams.py).
        """
        if buf.device.type != "cuda":
            self._send_message(msg, seg, buf, None)
            return
        with self._streams.after(buf.device, [op.ready for op in msg.ops]) as stream:
            self._send_message(msg, seg, buf, stream)

    def _send_message(self, msg: Message, seg: int | None, buf: torch.Tensor,
                      stream: Any) -> None:
        transport = self._transport_for(buf.device)
        opts = AllreduceOptions()
        opts.reduceOp = msg.ops[0].reduce_op
        pool = None
        if seg is not None:
            pool = self._pools[msg.key]
            t_pack = now_us()
            pack(msg.ops, buf)
            if TIMELINE.enabled:
                TIMELINE.complete(tl.FUSE, tl.CAT_ENGINE, t_pack, now_us() - t_pack, tid="engine",
                                  args={"tensors": len(msg.ops), "bytes": msg.nbytes})
        with self._cv:
            self._inflight += 1
        self.counters.messages += 1
        self.counters.fused_tensors += len(msg.ops)
        if TIMELINE.enabled:
            t = now_us()
            for op in msg.ops:
                q0 = getattr(op, "queued_us", None)
                if q0 is not None:
                    TIMELINE.complete(tl.QUEUE, tl.CAT_ENGINE, q0, t - q0, tid="queue",
                                      args={"seq": op.seq})
        msg.sent_s = time.perf_counter()
        if stream is not None and seg is not None:
            # The segment was allocated on another stream: a later free of it (when it grows)
            # must wait for what this stream still does with it.
            buf.record_stream(stream)
        work = transport.allreduce([buf], opts)
        if stream is None:
            with self._reap_cv:
                self._reap.append((work, msg, buf, pool, seg))
                if self._reaper is None:
                    self._reaper = threading.Thread(target=self._reap_main, daemon=True,
                                                    name=f"{self._name}-reaper")
                    self._reaper.start()
                self._reap_cv.notify()
        else:
            # CUDA: Work.wait() orders this stream after the transport without a host wait, so
            # the unpack is queued now, and the next pack into this segment behind it.
            self._message_done(work, msg, buf, pool, seg, stream)

    def _reap_main(self) -> None:
        """CPU: wait for each fused message's transport Work in launch order, then finish it.

        gloo's own threads never run Python. A `.then` callback on them waited for the GIL
        while the issuing caller, the engine and the pool held it, and gloo's worker could not
        start the next allreduce meanwhile; before that, unpacking there left a gap on the
        wire after every message (3-4 ms per 30 MB). Measured A/B in one launch, ResNet-50
        list, 4 ranks: 289 vs 307 ms per list (64 MB), 284 vs 320 (128 MB, solo 2 MB), the
        ranks' CPU 136-137 vs 148-153 ms; 2 ranks within noise. Futures that may carry user
        callbacks still complete on the pool (_finish_ops): a callback that blocks must
        never stop the reaping.
        """
        while True:
            with self._reap_cv:
                while not self._reap:
                    if self._closing:
                        return
                    self._reap_cv.wait()
                work, msg, buf, pool, seg = self._reap.popleft()
            try:
                # Its work.wait() releases the GIL: gloo's thread only signals a C++ condition.
                self._message_done(work, msg, buf, pool, seg)
            except BaseException as exc:  # noqa: BLE001 - a bug here must fail, not hang
                self._finish_ops(msg.ops, self._fail(exc))

    def _message_done(self, work: Any, msg: Message, buf: torch.Tensor,
                      pool: SegmentPool | None, seg: int | None, stream: Any = None) -> None:
        """Finish `msg` once `work`, its transport allreduce, is done: record it, unpack it,
        free its segment, complete its Works.

        On CPU this runs on the reaper thread, where work.wait() blocks (without the GIL); on
        CUDA on the engine thread with the engine's `stream` current, where work.wait() only
        orders that stream after the transport.
        """
        error = None
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the Works below
            error = exc
        t_done = time.perf_counter()
        comm_s = t_done - msg.sent_s
        STATS.record_message(len(msg.ops), msg.nbytes, msg.numel * 4, comm_s)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.ALLREDUCE, tl.CAT_COMM, now_us() - comm_s * 1e6, comm_s * 1e6,
                              tid=f"transport {seg if seg is not None else 'solo'}",
                              args={"tensors": len(msg.ops), "bytes": msg.nbytes,
                                    "first_seq": msg.ops[0].seq})
        try:
            if error is None and pool is not None:
                t0 = time.perf_counter()
                unpack(buf, msg.ops)
                if TIMELINE.enabled:
                    u = (time.perf_counter() - t0) * 1e6
                    TIMELINE.complete(tl.UNPACK, tl.CAT_ENGINE, now_us() - u, u,
                                      tid=f"transport {seg}")
        except BaseException as exc:  # noqa: BLE001
            error = exc
        finally:
            if pool is not None:
                pool.release(seg)
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
        if isinstance(error, StepFailed):
            # [algorithms] Failed alike on every rank (agreed): only this message's ops fail;
            # the group stays usable for the next message.
            self._finish_ops(msg.ops, error)
            return
        if error is not None:
            # Fail the group first, so these Works carry its explained error (which rank died,
            # what differed) like every later call, not the transport's raw one.
            error = self._fail(EngineError(
                f"gradientflow: rank {self.rank}: fused allreduce of {len(msg.ops)} tensor(s) "
                f"(sequence numbers {msg.ops[0].seq}-{msg.ops[-1].seq}) failed: {error}"))
        if error is None and stream is not None:
            # CUDA: the futures record an event on the engine's stream that waiters sync with.
            completion.complete_all([(op.fut, [op.tensor], None) for op in msg.ops], stream)
            return
        self._finish_ops(msg.ops, error)

    def future_of(self, op: FusableOp, public: bool = False) -> torch.futures.Future | None:
        """The future of fused op `op`, made now if it has none.

        For a blocking wait (`public` False): None if the op is already done. For
        get_future() (`public` True): its public future (completion.public); if `op` is not
        done yet, it is marked `chained`, so its completion runs on the pool, never on the
        reaper, where a user callback that blocks would stall every later message.
        """
        with self._chain_lock:
            fut = op.fut
            if fut is None:
                if op.done and not public:
                    return None
                fut = op.fut = completion.new_source()
                if op.done:  # nothing is attached to it yet: settle it here
                    completion.settle(fut, [op.tensor], op.error)
            if public:
                if not fut.done():
                    op.chained = True
                return completion.public(fut)
            return fut

    def _finish_ops(self, ops: list[FusableOp], error: BaseException | None) -> None:
        """Mark fused ops done (values written back, or failed with `error`) and settle the
        futures somebody asked for: here when only our own wait() is attached to them, on the
        pool (which a blocked callback cannot stall) when get_future() handed them out.

        Settling a future per op, and its pool hop per message, cost more than the rest of a
        message's completion; a per-tensor loop asks for neither.
        """
        pooled = []
        with self._chain_lock:  # future_of() settles what it makes for an op already done
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
                        completion.settle(fut, [op.tensor])
        if pooled:
            completion.complete_all(pooled)

    def _run_eager(self, op: EagerOp) -> None:
        if op.device is not None and op.device.type == "cuda":
            with self._streams.after(op.device, [op.ready]) as stream:
                try:
                    op.launch().wait()  # orders the engine's stream after it; no host wait
                except BaseException as exc:  # noqa: BLE001 - the group is broken
                    completion.complete(op.fut, error=self._fail(exc))
                    return
            completion.complete(op.fut, op.outputs, stream=stream)
            return
        work = op.launch()

        def done(f, op=op, work=work):
            try:
                f.value()
                completion.complete(op.fut, op.outputs)
            except BaseException as exc:  # noqa: BLE001 - a transport failure: the group is broken
                completion.complete(op.fut, error=self._fail(exc))

        work.get_future().then(done)

    def _run_stages(self, op: StagesOp) -> None:
        # Any error inside a multi-stage op leaves the other ranks one collective ahead or
        # behind: the group cannot stay consistent, so it fails the op and then the engine.
        transport = self._transport_for(op.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        lane = f"bucket {op.key}" if op.key is not None else "stages"
        with self._streams.after(op.device, [op.ready]) as stream:
            self._stages_on(op, transport, opts, lane, stream)

    def _stages_on(self, op: StagesOp, transport: Any, opts: AllreduceOptions, lane: str,
                   stream: Any) -> None:
        """_run_stages' body, with `stream` (CUDA: the engine's) current."""
        t0 = time.perf_counter()
        codec_name = tl.COMPRESS
        try:
            tensor = next(op.gen)
            while True:
                t1 = time.perf_counter()
                self._stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
                STATS.record_codec_time(t1 - t0)
                transport.allreduce([tensor], opts).wait()
                t0 = time.perf_counter()
                STATS.record_message(1, tensor.numel() * tensor.element_size(), 0, t0 - t1)
                self._stage_event(tl.ALLREDUCE, tl.CAT_COMM, t1, t0, lane)
                codec_name = tl.DECOMPRESS
                tensor = op.gen.send(tensor)
        except StopIteration as stop:
            t1 = time.perf_counter()
            STATS.record_codec_time(t1 - t0)
            STATS.record_bytes(0, op.dense_bytes)
            self._stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
            completion.complete(op.fut, stop.value, stream=stream)
        except StepFailed as exc:  # [algorithms] agreed on every rank: the group goes on
            completion.complete(op.fut, error=exc)
        except BaseException as exc:
            completion.complete(op.fut, error=self._fail(exc))
            raise

    @staticmethod
    def _stage_event(name: str, cat: str, t0: float, t1: float, lane: str) -> None:
        if TIMELINE.enabled:
            dur = (t1 - t0) * 1e6
            TIMELINE.complete(name, cat, now_us() - (time.perf_counter() - t0) * 1e6, dur,
                              tid=lane)

    # ------------------------------------------------------------------ introspection
    def fusion_memory_bytes(self) -> int:
        """Bytes held by persistent fusion buffers."""
        return sum(p.allocated_bytes for p in self._pools.values())
