"""The engine thread's jobs: each a small type whose `run(parts)` does one step of the pipeline.

The ordered queue (queue.py) holds issued ops and hands the engine thread one job at a time:

- `AgreeBatch`: run the agreement round for the leading deferred ops, then cut the agreed
  batch into messages (rounds.py, fusion.plan_messages);
- `SendMessage`: pack a fused message into its segment (or take a solo tensor in place) and
  hand it to the transport (messages.py);
- `EagerOp`: a collective sent as issued, in sequence order;
- `Prepare`: a queued stage op's local work (a compressed bucket's norms), ahead of its batch;
- `StagesBatch`: an agreed batch of multi-collective ops (compressed buckets), fused: their
  stages back to back, the last one left in flight while the engine goes on.

A job sees the pipeline's parts it works with (`JobParts`: the queue, the rounds, the messages,
streams and statistics, and two callbacks into the engine), never the engine itself, so a job
can be read, and run in a test, alone. `run` may raise: the engine then fails the group with
the error (Engine.fail).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sized

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.errors import CollectiveMismatchError, StepFailed
from gradientflow.engine import completion
from gradientflow.engine.checks import Check, refuses_only_the_call
from gradientflow.engine.fusion import FusableOp, Message
from gradientflow.engine.stages import StagesOp, unwrap
from gradientflow.observability import timeline as tl
from gradientflow.observability.stats import GroupStats
from gradientflow.observability.timeline import TIMELINE, now_us

if TYPE_CHECKING:
    from gradientflow.engine.messages import Messages
    from gradientflow.engine.rounds import Rounds
    from gradientflow.engine.streams import EngineStreams


class JobQueue(Protocol):
    """What jobs read and change of the ordered queue (queue.OrderedQueue, which hands out
    these jobs and so imports this module, not the other way round)."""

    wanted_upto: int  # the highest sequence number somebody waits on
    issued: Sized  # ops issued and not yet agreed

    def take_batch(self, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class JobParts:
    """What the engine thread's jobs work with: the pipeline's parts, not the engine."""

    rank: int
    cv: threading.Condition  # the engine's state lock; the queue and `checking` live under it
    queue: JobQueue
    rounds: Rounds
    messages: Messages
    streams: EngineStreams
    stats: GroupStats
    transport_for: Callable[[torch.device], Any]
    # Sum a stage's tensor of two ranks by one exchange, in place (Engine._swap): True, or
    # False where the transport's allreduce must carry it.
    swap: Callable[[torch.Tensor], bool]
    checking: set  # sequence numbers of the eager calls in their round now (Issue.checking)
    # Fail the group with an error (explained once); returns the group's error.
    fail: Callable[[BaseException], BaseException]
    # A round refused the first n queued ops alike on every rank (n=0: the eager calls seqs).
    refuse: Callable[[int, BaseException, list | None], None]


@dataclass(slots=True)
class AgreeBatch:
    """Agree how many of `candidates` (the leading deferred ops) every rank has queued."""

    candidates: list[FusableOp]

    def run(self, parts: JobParts) -> None:
        cands = self.candidates
        with parts.cv:  # every candidate is waited on, and nothing is queued behind them
            queue = parts.queue
            waited = (queue.wanted_upto >= cands[-1].seq and len(queue.issued) == len(cands)
                      and isinstance(cands[0], FusableOp))
        try:
            n = parts.rounds.agree(cands, waited)
        except CollectiveMismatchError as err:
            refused = getattr(err, "refused", None)
            if not refused:
                raise
            parts.refuse(refused, err, None)  # alike on every rank: the group goes on
            return
        with parts.cv:
            parts.queue.take_batch(n)


@dataclass(slots=True)
class Prepare:
    """Run a queued stage op's local work ahead of its batch (`part.prepare()`): the engine
    thread would otherwise idle until the run closes. Touches no collective, so it cannot
    change what pairs across ranks."""

    op: StagesOp

    def run(self, parts: JobParts) -> None:
        t0 = time.perf_counter()
        self.op.part.prepare()
        t1 = time.perf_counter()
        parts.stats.record_codec_time(t1 - t0)
        _stage_event(tl.COMPRESS, tl.CAT_CODEC, t0, t1, f"bucket {self.op.key}")


@dataclass(slots=True)
class SendMessage:
    """Hand agreed message `msg` to the transport, from segment `seg` (None: in place)."""

    msg: Message
    seg: int | None
    buf: torch.Tensor

    def run(self, parts: JobParts) -> None:
        parts.messages.launch(self.msg, self.seg, self.buf)


class Claim:
    """An eager collective that holds the queue's floor: its round and its launch run on the
    caller's thread once the engine's lock is released (Issue._run_claim). Stands in for its
    Work (in the inspector's records) until it is launched."""

    __slots__ = ("check", "launch", "wrap", "refusable", "work")

    def __init__(self, check: Check, launch: Callable[[], Any],
                 wrap: Callable[[Any], Any] | None = None, refusable: bool = True) -> None:
        self.check = check
        self.launch = launch
        self.wrap = wrap
        self.refusable = refusable  # False: part of it was sent already (a barrier's solo part)
        self.work: Any = None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()


@dataclass
class EagerOp:
    """A collective sent as issued, in sequence order: its round (checks.py) on the engine
    thread, then launch() hands it to the transport."""

    seq: int
    name: str
    launch: Callable[[], Any]  # -> c10d Work
    outputs: Any
    fut: torch.futures.Future
    device: torch.device | None = None
    ready: Any = None  # CUDA: streams.mark() of the submitting thread's stream
    check: Any = None  # its Check, agreed in a round before anything is sent
    refusable: bool = True  # False: a mismatch fails the group (part of it was sent)

    def run(self, parts: JobParts) -> None:
        if self.check is not None and not self._checked(parts):
            return
        self._launch(parts)

    def _checked(self, parts: JobParts) -> bool:
        """Run the round; False if it refused the call (its Work then raises why)."""
        with parts.cv:
            parts.checking.add(self.seq)
        with parts.cv:
            waited = self.check.waited or parts.queue.wanted_upto >= self.seq
        try:
            parts.rounds.check(self.check, waited)
        except Exception as err:  # noqa: BLE001 - anything but a refusal fails the group
            if not refuses_only_the_call(err, self.refusable):
                raise
            parts.refuse(0, err, [self.seq])
            completion.complete(self.fut, error=err)
            return False
        finally:
            with parts.cv:
                parts.checking.discard(self.seq)
        return True

    def _launch(self, parts: JobParts) -> None:
        # A transport may return no Work for a synchronous call (the caller's asyncOp=False):
        # NCCL then runs it on the current stream, gloo before returning.
        if self.device is not None and self.device.type == "cuda":
            with parts.streams.after(self.device, [self.ready]) as stream:
                try:
                    work = self.launch()
                    if work is not None:
                        work.wait()  # orders the engine's stream after it; no host wait
                except StepFailed as exc:  # [algorithms] agreed on every rank: the group goes on
                    completion.complete(self.fut, error=exc)
                    return
                except BaseException as exc:  # noqa: BLE001 - the group is broken
                    completion.complete(self.fut, error=parts.fail(exc))
                    return
            completion.complete(self.fut, self.outputs, stream=stream)
            return
        work = self.launch()
        if work is None:
            completion.complete(self.fut, self.outputs)
            return

        # Every transport Work has a future (backend/adapter.py gives one to gloo's that lack it).
        work.get_future().then(
            lambda f, op=self: completion.follow(f, op.fut, op.outputs, parts.fail))


@dataclass
class StagesBatch:
    """Agreed stage ops of one fuser and device (stages.plan_batches), run as one op.

    Every stage but the last is waited on here, on the engine thread, so the engine hands the
    transport every batch's collectives in batch order on every rank. The last stage (marked
    Final) is only launched: on CPU the reaper waits for it and runs the rest of the generator
    (the unpack) there, while the engine thread agrees and launches the next batch; on CUDA
    waiting costs no host time, so it is finished in line. Any error inside it leaves the other
    ranks one collective ahead or behind: the group cannot stay consistent, so it fails the
    ops and then the engine (a StepFailed, agreed on every rank, fails only these ops).
    """

    ops: list[StagesOp]

    def run(self, parts: JobParts) -> None:
        ops = self.ops
        dev = ops[0].device
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        key = ops[0].key
        lane = f"bucket {key}" if key is not None and len(ops) == 1 else (
            f"stages {ops[0].seq}-{ops[-1].seq}")
        with parts.streams.after(dev, [op.ready for op in ops]) as stream:
            self._run(parts, parts.transport_for(dev), opts, lane, stream)

    def _run(self, parts: JobParts, transport: Any, opts: AllreduceOptions, lane: str,
             stream: Any) -> None:
        """run's body, with `stream` (CUDA: the engine's) current."""
        stats = parts.stats
        gen = self.ops[0].fuser([op.part for op in self.ops])
        t0 = time.perf_counter()
        codec_name = tl.COMPRESS
        try:
            tensor, final = unwrap(next(gen))
            while True:
                t1 = time.perf_counter()
                _stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
                stats.record_codec_time(t1 - t0)
                work = None if parts.swap(tensor) else transport.allreduce([tensor], opts)
                if final and stream is None:
                    parts.messages.later(
                        lambda: self._finish(parts, gen, work, tensor, t1, lane))
                    return
                if work is not None:
                    work.wait()
                t0 = time.perf_counter()
                stats.record_message(len(self.ops), tensor.numel() * tensor.element_size(), 0,
                                     t0 - t1)
                _stage_event(tl.ALLREDUCE, tl.CAT_COMM, t1, t0, lane)
                codec_name = tl.DECOMPRESS
                tensor, final = unwrap(gen.send(tensor))
        except StopIteration as stop:
            self._done(parts, stop.value, t0, codec_name, lane, stream)
        except StepFailed as exc:  # [algorithms] agreed on every rank: the group goes on
            self.fail(exc)
        except BaseException as exc:
            self.fail(parts.fail(exc))
            raise

    def _finish(self, parts: JobParts, gen: Any, work: Any, tensor: torch.Tensor, t1: float,
                lane: str) -> None:
        """The last stage landed (the reaper's thread): the rest of the generator, then the
        futures."""
        try:
            if work is not None:  # None: summed already (JobParts.swap)
                work.wait()
            t0 = time.perf_counter()
            parts.stats.record_message(len(self.ops), tensor.numel() * tensor.element_size(),
                                       0, t0 - t1)
            _stage_event(tl.ALLREDUCE, tl.CAT_COMM, t1, t0, lane)
            gen.send(tensor)
            raise RuntimeError(
                f"gradientflow: rank {parts.rank}: stage op {self.ops[0].describe()} yielded "
                "another stage after one marked Final; mark only the last stage Final")
        except StopIteration as stop:
            self._done(parts, stop.value, t0, tl.DECOMPRESS, lane, None)
        except StepFailed as exc:
            self.fail(exc)
        except BaseException as exc:  # noqa: BLE001 - the group is broken
            self.fail(parts.fail(exc))

    def _done(self, parts: JobParts, results: list, t0: float, codec_name: str, lane: str,
              stream: Any) -> None:
        t1 = time.perf_counter()
        parts.stats.record_codec_time(t1 - t0)
        parts.stats.record_bytes(0, sum(op.nbytes for op in self.ops))
        _stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
        if len(results) != len(self.ops):
            self.fail(parts.fail(RuntimeError(
                f"gradientflow: rank {parts.rank}: the fuser of {self.ops[0].describe()} "
                f"returned {len(results)} results for {len(self.ops)} ops")))
            return
        completion.complete_all([(op.fut, r, None) for op, r in zip(self.ops, results)], stream)

    def fail(self, err: BaseException) -> None:
        """Complete every op of the batch with `err`."""
        completion.complete_all([(op.fut, None, err) for op in self.ops])


def _stage_event(name: str, cat: str, t0: float, t1: float, lane: str) -> None:
    if TIMELINE.enabled:
        dur = (t1 - t0) * 1e6
        TIMELINE.complete(name, cat, now_us() - (time.perf_counter() - t0) * 1e6, dur, tid=lane)
