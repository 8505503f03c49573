"""Messages: persistent segments, the hand-off to the transport, and reaping what finished.

An agreed message is packed into a free segment of its key's pool (a solo tensor goes in
place), handed to the transport, and reaped in launch order: unpacked, its segment freed, its
ops completed (completion.FusedCompletion). On CPU a reaper thread waits for each transport
Work: gloo's own threads never run Python, and a `.then` callback there waited for the GIL
while the issuing caller held it, leaving a gap on the wire after every message. Futures that
may carry user callbacks still complete on the pool: a callback that blocks must never stop
the reaping. On CUDA the engine thread queues the unpack on its own stream right after the
send (streams.py): Work.wait() orders that stream after the transport without a host wait.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Hashable

import torch
from torch._C._distributed_c10d import AllreduceOptions

from gradientflow import threads
from gradientflow.engine import completion
from gradientflow.engine.fusion import Message, pack, unpack
from gradientflow.errors import StepFailed
from gradientflow.errors import EngineError
from gradientflow.observability import timeline as tl
from gradientflow.observability.timeline import TIMELINE, now_us


class SegmentPool:
    """Persistent fusion buffers of one key; a message takes any free one.

    Packing message i+1 into another segment overlaps the transport of message i; a segment
    is reused only after its message was unpacked. Which segment a message gets does not
    matter to the other ranks (only the transport order does), so the engine never waits for a
    particular one. Memory: at most `segments` buffers of `capacity` elements (the threshold)
    per key.

    Where a round cuts a batch depends on timing, so message sizes vary from step to step; a
    segment grows at least twofold (capped at `capacity`), so it is reallocated, and its pages
    faulted in again while packing, a few times at most rather than at every larger message.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, segments: int,
                 capacity: int) -> None:
        self._dtype = dtype
        self._device = device
        self._capacity = capacity
        self._buffers: list[torch.Tensor | None] = [None] * segments
        self._free = [True] * segments
        self._lock = threading.Lock()

    def try_acquire(self, numel: int) -> tuple[int, torch.Tensor] | None:
        """A free segment as (index, a view of `numel` elements), or None if all are in use."""
        with self._lock:
            try:
                idx = self._free.index(True)
            except ValueError:
                return None
            self._free[idx] = False
        buf = self._buffers[idx]
        if buf is None or buf.numel() < numel:
            old = 0 if buf is None else buf.numel()
            size = max(numel, min(self._capacity, 2 * old))
            buf = torch.empty(size, dtype=self._dtype, device=self._device)
            self._buffers[idx] = buf
        return idx, buf[:numel]

    def release(self, idx: int) -> None:
        """Mark segment `idx` reusable."""
        with self._lock:
            self._free[idx] = True

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)


class Messages:
    """The transport side of one engine: segment pools, messages in flight, the reaper.

    `cv` is the engine's condition: the in-flight count changes under it, and a freed segment
    wakes the engine thread, whose next message may be waiting for one.
    """

    def __init__(self, config: Any, name: str, rank: int, cv: threading.Condition,
                 transport_for: Callable[[torch.device], Any], streams: Any, stats: Any,
                 fused: completion.FusedCompletion,
                 fail: Callable[[BaseException], BaseException]) -> None:
        self._config = config
        self._name = name
        self._rank = rank
        self._cv = cv
        self._transport_for = transport_for
        self._streams = streams
        self._stats = stats
        self._fused = fused
        self._fail = fail
        self._pools: dict[Hashable, SegmentPool] = {}
        self.inflight = 0  # fused messages handed to the transport, not yet unpacked
        self._solo_last: Any = None  # the solo channel's last Work (still in flight?)
        # CPU: what is in flight, in launch order, for the reaper thread: each a callable that
        # waits for its transport Work and finishes it (a fused message, a batch's last stage).
        self._reap: collections.deque = collections.deque()
        self._reap_cv = threading.Condition()
        self._reaper: threading.Thread | None = None
        self._closing = False

    def configure(self, config: Any) -> None:
        """Take `config`'s segment count and size (nothing in flight, engine lock held).

        Pools are dropped when those change, and made again at the next message's size.
        """
        old, self._config = self._config, config
        if (old.fusion_segments, old.fusion_threshold) != (config.fusion_segments,
                                                           config.fusion_threshold):
            self._pools.clear()

    # ------------------------------------------------------------------ engine thread
    def busy(self) -> bool:
        """Whether messages are in flight, the solo channel's last one included (lock held)."""
        solo = self._solo_last
        if solo is not None and solo.is_completed():
            solo = self._solo_last = None  # (it keeps its tensor alive)
        return self.inflight > 0 or solo is not None

    def solo_sent(self, work: Any) -> None:
        """The solo channel sent `work` on the caller's thread (lock held)."""
        self._solo_last = work

    def acquire(self, msg: Message) -> tuple[int, torch.Tensor] | None:
        """A free segment of `msg`'s pool as (index, view), or None while all are in use."""
        pool = self._pools.get(msg.key)
        if pool is None:
            op = msg.ops[0]
            pool = self._pools[msg.key] = SegmentPool(
                op.tensor.dtype, op.tensor.device, self._config.fusion_segments,
                self._config.fusion_threshold // op.tensor.element_size())
        return pool.try_acquire(msg.numel)

    def launch(self, msg: Message, seg: int | None, buf: torch.Tensor) -> None:
        """Pack `msg` into its segment `seg` (None: a solo tensor sent in place) and send it.

        CUDA: on the engine's stream, once the callers' streams wrote the tensors (streams.py).
        """
        if buf.device.type != "cuda":
            self._send(msg, seg, buf, None)
            return
        with self._streams.after(buf.device, [op.ready for op in msg.ops]) as stream:
            self._send(msg, seg, buf, stream)

    def _send(self, msg: Message, seg: int | None, buf: torch.Tensor, stream: Any) -> None:
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
            self.inflight += 1
        self._stats.record_send(len(msg.ops))
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
            self._queue_reap(lambda: self._reaped(work, msg, buf, pool, seg))
        else:
            # CUDA: Work.wait() orders this stream after the transport without a host wait, so
            # the unpack is queued now, and the next pack into this segment behind it.
            self._done(work, msg, buf, pool, seg, stream)

    def later(self, finish: Callable[[], None]) -> None:
        """Have the reaper run `finish` (it waits for a launched Work and completes what
        waits on it), in launch order after what is in flight; counted in flight until then.
        `finish` must complete its own futures, failing them on error."""
        with self._cv:
            self.inflight += 1

        def run() -> None:
            try:
                finish()
            finally:
                with self._cv:
                    self.inflight -= 1
                    self._cv.notify_all()

        self._queue_reap(run)

    def _queue_reap(self, item: Callable[[], None]) -> None:
        with self._reap_cv:
            self._reap.append(item)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap_main, daemon=True,
                                                name=f"{self._name}-reaper")
                self._reaper.start()
            self._reap_cv.notify()

    # ------------------------------------------------------------------ reaper thread
    def _reap_main(self) -> None:
        """CPU: wait for each launched Work in launch order, then finish it."""
        while True:
            with self._reap_cv:
                while not self._reap:
                    if self._closing:
                        return
                    self._reap_cv.wait()
                item = self._reap.popleft()
            threads.follow_torch_threads()  # the unpack, a codec's last stage
            # A Work's wait() releases the GIL: gloo's thread only signals a C++ condition.
            item()

    def _reaped(self, work: Any, msg: Message, buf: torch.Tensor, pool: SegmentPool | None,
                seg: int | None) -> None:
        try:
            self._done(work, msg, buf, pool, seg)
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail, not hang
            self._fused.finish(msg.ops, self._fail(exc))

    def _done(self, work: Any, msg: Message, buf: torch.Tensor, pool: SegmentPool | None,
              seg: int | None, stream: Any = None) -> None:
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
        comm_s = time.perf_counter() - msg.sent_s
        self._stats.record_message(len(msg.ops), msg.nbytes, msg.numel * 4, comm_s)
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
                self.inflight -= 1
                self._cv.notify_all()
        if isinstance(error, StepFailed):
            # [algorithms] Failed alike on every rank (agreed): only this message's ops fail;
            # the group stays usable for the next message.
            self._fused.finish(msg.ops, error)
            return
        if error is not None:
            # Fail the group first, so these Works carry its explained error (which rank died,
            # what differed) like every later call, not the transport's raw one.
            error = self._fail(EngineError(
                f"gradientflow: rank {self._rank}: fused allreduce of {len(msg.ops)} tensor(s) "
                f"(sequence numbers {msg.ops[0].seq}-{msg.ops[-1].seq}) failed: {error}"))
        if error is None and stream is not None:
            # CUDA: the futures record an event on the engine's stream that waiters sync with.
            completion.complete_all([(op.fut, [op.tensor], None) for op in msg.ops], stream)
            return
        self._fused.finish(msg.ops, error)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout_s: float) -> None:
        """Let the reaper end once what is in flight is finished, and join it."""
        with self._reap_cv:
            self._closing = True
            self._reap_cv.notify_all()
        if self._reaper is not None:
            self._reaper.join(timeout_s)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the persistent segments."""
        return sum(p.allocated_bytes for p in self._pools.values())
