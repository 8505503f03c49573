"""The engine thread's jobs: each a small type whose `run(engine)` does one step of the pipeline.

The ordered queue (queue.py) holds issued ops and hands the engine thread one job at a time:

- `AgreeBatch`: run the agreement round for the leading deferred ops, then cut the agreed
  batch into messages (rounds.py, fusion.plan_messages);
- `SendMessage`: pack a fused message into its segment (or take a solo tensor in place) and
  hand it to the transport (messages.py);
- `EagerOp`: a collective sent as issued, in sequence order;
- `StagesOp`: a multi-collective op (a compressed bucket), its stages back to back.

`run` may raise: the engine then fails the group with the error (Engine.fail).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.errors import StepFailed
from gradientflow.engine import completion
from gradientflow.engine.fusion import FusableOp, Message
from gradientflow.engine.stages import StageGen
from gradientflow.observability import timeline as tl
from gradientflow.observability.timeline import TIMELINE, now_us


@dataclass(slots=True)
class AgreeBatch:
    """Agree how many of `candidates` (the leading deferred ops) every rank has queued."""

    candidates: list[FusableOp]

    def run(self, engine: Any) -> None:
        n = engine.rounds.agree(self.candidates)
        with engine.cv:
            engine.queue.take_batch(n)


@dataclass(slots=True)
class SendMessage:
    """Hand agreed message `msg` to the transport, from segment `seg` (None: in place)."""

    msg: Message
    seg: int | None
    buf: torch.Tensor

    def run(self, engine: Any) -> None:
        engine.messages.launch(self.msg, self.seg, self.buf)


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

    def run(self, engine: Any) -> None:
        if self.device is not None and self.device.type == "cuda":
            with engine.streams.after(self.device, [self.ready]) as stream:
                try:
                    self.launch().wait()  # orders the engine's stream after it; no host wait
                except BaseException as exc:  # noqa: BLE001 - the group is broken
                    completion.complete(self.fut, error=engine.fail(exc))
                    return
            completion.complete(self.fut, self.outputs, stream=stream)
            return
        work = self.launch()

        def done(f, op=self, work=work):
            try:
                f.value()
                completion.complete(op.fut, op.outputs)
            except BaseException as exc:  # noqa: BLE001 - a transport failure: the group is broken
                completion.complete(op.fut, error=engine.fail(exc))

        work.get_future().then(done)


@dataclass
class StagesOp:
    """A multi-collective op (a compressed bucket): its stages run back to back on the engine.

    Any error inside it leaves the other ranks one collective ahead or behind: the group
    cannot stay consistent, so it fails the op and then the engine.
    """

    seq: int
    name: str
    gen: StageGen
    device: torch.device
    fut: torch.futures.Future
    key: Hashable = None
    dense_bytes: int = 0  # the dense FP32 size of what the stages carry (for statistics)
    ready: Any = None  # CUDA: streams.mark() of the submitting thread's stream

    def run(self, engine: Any) -> None:
        transport = engine.transport_for(self.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        lane = f"bucket {self.key}" if self.key is not None else "stages"
        with engine.streams.after(self.device, [self.ready]) as stream:
            self._stages(engine, transport, opts, lane, stream)

    def _stages(self, engine: Any, transport: Any, opts: AllreduceOptions, lane: str,
                stream: Any) -> None:
        """run's body, with `stream` (CUDA: the engine's) current."""
        stats = engine.stats
        gen = self.gen
        t0 = time.perf_counter()
        codec_name = tl.COMPRESS
        try:
            tensor = next(gen)
            while True:
                t1 = time.perf_counter()
                _stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
                stats.record_codec_time(t1 - t0)
                transport.allreduce([tensor], opts).wait()
                t0 = time.perf_counter()
                stats.record_message(1, tensor.numel() * tensor.element_size(), 0, t0 - t1)
                _stage_event(tl.ALLREDUCE, tl.CAT_COMM, t1, t0, lane)
                codec_name = tl.DECOMPRESS
                tensor = gen.send(tensor)
        except StopIteration as stop:
            t1 = time.perf_counter()
            stats.record_codec_time(t1 - t0)
            stats.record_bytes(0, self.dense_bytes)
            _stage_event(codec_name, tl.CAT_CODEC, t0, t1, lane)
            completion.complete(self.fut, stop.value, stream=stream)
        except StepFailed as exc:  # [algorithms] agreed on every rank: the group goes on
            completion.complete(self.fut, error=exc)
        except BaseException as exc:
            completion.complete(self.fut, error=engine.fail(exc))
            raise


def _stage_event(name: str, cat: str, t0: float, t1: float, lane: str) -> None:
    if TIMELINE.enabled:
        dur = (t1 - t0) * 1e6
        TIMELINE.complete(name, cat, now_us() - (time.perf_counter() - t0) * 1e6, dur, tid=lane)
