"""Keyed scheduling: launch gradient partitions in priority order among those ready on EVERY rank.

The DistributedOptimizer's partitions become ready during backward in timing-dependent order,
which differs between ranks. Launching "the most urgent ready partition" from local state would
pair different partitions across ranks. So each launch decision comes from an agreement round:
every rank contributes a 0/1 vector of its locally ready keys, MIN over ranks is the set ready
everywhere, and the launch order is a pure function of that set and the static priorities
(TicTac's order: the partition the next forward pass needs first goes first). A credit bounds
the bytes launched per decision, so a newly ready first-layer partition is not stuck behind a
large late one (ByteScheduler): after the credit is spent, the next round re-decides.

Why a stream of its own (its own agreement group, its own transport group, its own thread):
rounds of the sequence engine are positioned by the call sequence (one per batch of deferred
allreduces), but keyed rounds are positioned by time (a rank whose partitions are not ready
yet must still answer). Sharing one thread would let rank 0 block in a keyed round while rank 1
blocks in a sequenced collective waiting for rank 0: a deadlock. Two independent ordered
streams cannot wait on each other, and each is consistent across ranks on its own.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from gradientflow.engine import completion
from gradientflow.engine.stages import StageGen
from gradientflow.observability import timeline as tl
from gradientflow.observability.stats import STATS
from gradientflow.observability.timeline import TIMELINE, now_us

MAX_KEYS = 1024  # most partitions one step may declare (the round carries one slot per key)


@dataclass
class KeyedOp:
    """One partition's multi-stage op, waiting for its key to be agreed ready everywhere."""

    key: int
    priority: int
    gen: StageGen
    device: torch.device
    nbytes: int
    fut: torch.futures.Future


class KeyedScheduler:
    """Agrees on ready keys with the other ranks and runs their ops in priority order."""

    def __init__(self, rank: int, world_size: int, agree_group: Any,
                 transport_for: Callable[[torch.device], Any], credit_bytes: int,
                 poll_ms: float, timeout_s: float, name: str = "gradientflow") -> None:
        self.rank = rank
        self.world_size = world_size
        self._agree = agree_group
        self._transport_for = transport_for
        self.credit_bytes = credit_bytes
        self.poll_s = poll_ms / 1000.0
        self.timeout_s = timeout_s
        self._name = name
        self._cv = threading.Condition()
        self._outstanding: set[int] = set()  # declared this step, not launched yet
        self._ready: dict[int, KeyedOp] = {}
        self._fresh = False  # a key became ready locally since the last round
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
            self._outstanding = set(range(num_keys))
            self.launch_log = []
            self._cv.notify_all()

    def submit(self, key: int, priority: int, gen: StageGen, device: torch.device,
               nbytes: int) -> torch.futures.Future:
        """Mark `key` ready locally; its op runs once every rank has it ready (by priority)."""
        fut, public = completion.new_future()
        with self._cv:
            self._raise_if_broken()
            if key not in self._outstanding or key in self._ready:
                raise RuntimeError(
                    f"gradientflow: rank {self.rank}: partition {key} submitted twice or not "
                    "declared for this step (call begin() once per step, submit each key once)")
            self._ready[key] = KeyedOp(key, priority, gen, device, nbytes, fut)
            self._fresh = True
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
            for op in self._ready.values():
                completion.complete(op.fut, error=err)
            self._ready.clear()
            self._outstanding.clear()
            self._cv.notify_all()
        self._thread.join(5.0)

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"gradientflow: rank {self.rank}: the scheduler of process group "
                               f"{self._name} failed earlier: {self._error}") from self._error
        if self._closing:
            raise RuntimeError(f"gradientflow: rank {self.rank}: process group {self._name} "
                               "was destroyed")

    # ------------------------------------------------------------------ scheduler thread
    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._outstanding:
                    self._cv.wait()
                if self._closing:
                    return
                if not self._fresh:
                    # Nothing new here: still answer the other ranks' rounds, at a slow poll.
                    self._cv.wait(self.poll_s)
                    if self._closing:
                        return
                self._fresh = False
                bits = torch.zeros(MAX_KEYS, dtype=torch.int64)
                for key in self._ready:
                    bits[key] = 1
            try:
                agreed = self._round(bits)
                self._launch(agreed)
            except BaseException as exc:  # noqa: BLE001 - fail loudly, never hang
                with self._cv:
                    self._error = exc
                    for op in self._ready.values():
                        completion.complete(op.fut, error=exc)
                    self._ready.clear()
                    self._outstanding.clear()
                return

    def _round(self, bits: torch.Tensor) -> list[int]:
        t0 = time.perf_counter()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self._agree.allreduce([bits], opts).wait()
        dt = time.perf_counter() - t0
        self.rounds += 1
        STATS.record_agreement(dt)
        if TIMELINE.enabled:
            TIMELINE.complete(tl.AGREE, tl.CAT_AGREE, now_us() - dt * 1e6, dt * 1e6,
                              tid="scheduler")
        return torch.nonzero(bits).flatten().tolist()

    def _launch(self, agreed: list[int]) -> None:
        with self._cv:
            ops = sorted((self._ready[k] for k in agreed), key=lambda o: (o.priority, o.key))
        spent = 0
        for op in ops:
            if spent and spent + op.nbytes > self.credit_bytes:
                with self._cv:
                    self._fresh = True  # the rest is still ready: decide again at once
                break
            with self._cv:
                del self._ready[op.key]
                self._outstanding.discard(op.key)
            self.launch_log.append(op.key)
            spent += op.nbytes
            self._run(op)

    def _run(self, op: KeyedOp) -> None:
        transport = self._transport_for(op.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        lane = f"partition {op.key}"
        try:
            tensor = next(op.gen)
            while True:
                t1 = time.perf_counter()
                transport.allreduce([tensor], opts).wait()
                dt = time.perf_counter() - t1
                STATS.record_message(1, tensor.numel() * tensor.element_size(), 0, dt)
                if TIMELINE.enabled:
                    TIMELINE.complete(tl.ALLREDUCE, tl.CAT_COMM, now_us() - dt * 1e6, dt * 1e6,
                                      tid=lane, args={"key": op.key, "priority": op.priority})
                tensor = op.gen.send(tensor)
        except StopIteration as stop:
            completion.complete(op.fut, stop.value)
        except BaseException as exc:
            completion.complete(op.fut, error=exc)
            raise
