"""Lazy allreduce's plan: the queued op, the message, and the pure cut of an agreed batch.

Everything here is a pure function of the agreed batch (the same on every rank), so every
rank cuts the same messages in the same order without talking.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from gradientflow.fingerprint import mix, redop_name, tensor_fingerprint


class FusableOp:
    """One queued async allreduce: the unit the engine fuses.

    A plain class with slots: one is made per queued allreduce (161 per ResNet-50 step) on the
    caller's thread, and numel and nbytes, read several times per op, are computed once.

    Completion (messages.py, completion.py): a CPU op is made without a future. The reaper
    marks it `done` (with `error` on failure) and settles `fut` only if somebody asked for
    one meanwhile (a blocking wait, get_future): a per-tensor loop waits on Works that are
    already done, and making and settling a torch Future per op cost more than the rest of
    its completion.
    A CUDA op carries its future from the start: its completion records a stream event
    that waiters must sync with, so `done` is never set on success there.
    """

    __slots__ = ("seq", "tensor", "key", "reduce_op", "fut", "ready", "name", "queued_us",
                 "numel", "nbytes", "done", "error", "chained", "priority")

    def __init__(self, seq: int, tensor: torch.Tensor, key: Hashable, reduce_op: object,
                 fut: torch.futures.Future | None = None, ready: Any = None,
                 priority: int | None = None) -> None:
        self.seq = seq
        self.tensor = tensor
        self.key = key  # (device, dtype, reduce op): one fusion queue per key
        self.reduce_op = reduce_op
        self.fut = fut  # CUDA: from the start; CPU: made on demand (completion.FusedCompletion)
        self.ready = ready  # CUDA: streams.mark() of the submitting thread's stream
        self.name = "allreduce"
        self.queued_us: float | None = None  # timeline: when it was queued (while recording)
        self.numel = tensor.numel()
        self.nbytes = self.numel * tensor.element_size()
        self.done = False  # CPU: finished (values written back, or failed with `error`)
        self.error: BaseException | None = None
        self.chained = False  # its public future was handed out: settle `fut` on the pool
        # Lower leaves first among the ops one round agrees (plan_messages); None: issue order.
        self.priority = priority

    @property
    def reduce_op_name(self) -> str:
        return redop_name(self.reduce_op)

    def describe(self) -> str:
        return (f"#{self.seq} all_reduce {self.tensor.dtype} {tuple(self.tensor.shape)} "
                f"{self.reduce_op_name}")

    @property
    def fingerprint(self) -> int:
        """A process-independent hash of what must match across ranks: dtype, shape, op, and
        the priority (it decides the message order, so it must be the same everywhere)."""
        fp = tensor_fingerprint(self.tensor.dtype, self.tensor.shape, self.key[2])
        return fp if self.priority is None else mix(fp, self.priority + 1)


@dataclass(slots=True)
class Message:
    """One transport allreduce: a single op sent in place, or several packed into a buffer."""

    key: Hashable
    ops: list[FusableOp] = field(default_factory=list)
    nbytes: int = 0
    numel: int = 0
    sent_s: float = 0.0  # perf_counter when handed to the transport

    @property
    def solo(self) -> bool:
        return len(self.ops) == 1 and self.ops[0].tensor.is_contiguous()


def pack(ops: Sequence[FusableOp], buf: torch.Tensor) -> None:
    """Copy the ops' tensors into `buf`, back to back, in one call."""
    torch.cat([op.tensor.reshape(-1) for op in ops], out=buf)


def unpack(buf: torch.Tensor, ops: Sequence[FusableOp]) -> None:
    """Copy `buf`'s pieces back into the ops' tensors, in one call: a copy_ per tensor releases
    and re-takes the GIL each time, a hand-off to the issuing thread per tensor."""
    srcs = buf.split([op.numel for op in ops])
    torch._foreach_copy_([op.tensor for op in ops],
                         [src.view(op.tensor.shape) for src, op in zip(srcs, ops)])


def solo_cut(threshold: int, solo_bytes: int) -> int:
    """The size from which a tensor goes alone: `solo_bytes`, at most `threshold` (0: it)."""
    return min(solo_bytes, threshold) if solo_bytes > 0 else threshold


def plan_messages(batch: Sequence[FusableOp], threshold: int,
                  solo_bytes: int = 0) -> list[Message]:
    """Cut an agreed batch into messages: per key, greedy up to `threshold` bytes; a tensor of
    at least `solo_bytes` (0: `threshold`) bytes goes alone, in place (no copy).

    A message is emitted when it is full, a solo tensor at once; a solo tensor does not close
    the fused message of its key, which collects the small tensors around it. Messages still
    open at the end of the batch follow, in order of their keys' first appearance. Separate
    keys keep an fp16 tensor between fp32 ones from breaking the fp32 fusion.

    Priority (TicTac's order): where ops carry one, the batch is taken in priority order (ops
    without one first, in issue order), so of the partitions every rank agreed ready at once,
    the one the next forward needs first leaves first. The batch is the same on every rank,
    so the order is too.
    """
    if any(op.priority is not None for op in batch):
        batch = sorted(batch, key=_priority_key)
    solo = solo_cut(threshold, solo_bytes)
    out: list[Message] = []
    open_msgs: dict[Hashable, Message] = {}
    for op in batch:
        if op.nbytes >= solo:
            out.append(Message(op.key, [op], op.nbytes, op.numel))
            continue
        cur = open_msgs.get(op.key)
        if cur is not None and cur.nbytes + op.nbytes > threshold:
            out.append(cur)
            cur = None
        if cur is None:
            cur = open_msgs[op.key] = Message(op.key)
        cur.ops.append(op)
        cur.nbytes += op.nbytes
        cur.numel += op.numel
    return out + list(open_msgs.values())


def _priority_key(op: FusableOp) -> tuple[int, int]:
    return (-1 if op.priority is None else op.priority, op.seq)
