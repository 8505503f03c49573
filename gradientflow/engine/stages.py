"""The multi-stage op contract shared by compressors and the engine, and how ops are fused.

A compressed gradient bucket is one op with several collective stages (chunk norms, then the
packed chunks). Compressors express it as a generator that *yields* each tensor to be
SUM-allreduced in place and receives it back reduced; its return value is the op's result:

    def reduce(flat):                 # a StageGen
        norms = local_norms(flat)
        norms = yield norms           # every rank's norms, summed
        packed = pack(flat, select(norms))
        packed = yield Final(packed)  # every rank's packed chunks, summed; the last stage
        return unpack(packed)

Marking the last stage `Final` lets the engine hand its collective to the transport and go on
to the next batch while it runs: the rest of the generator (the unpack) runs when it lands.

The engine fuses the stage ops that are queued together (a *batch*, agreed across ranks like
the deferred allreduces, cut by `plan_batches`): one `fuser(parts)` StageGen drives every op
of a batch, so a batch of k buckets makes as many collectives as one bucket. `fuse` is the
generic fuser (stage by stage, same-dtype tensors concatenated); a compressor may bring its
own (CSC chooses chunks across the whole batch). Compression code never sees a process group;
tests run N "ranks" in one process with `drive_lockstep`.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, Hashable, Sequence

import torch

from gradientflow.fingerprint import mix, name_id

StageGen = Generator[Any, torch.Tensor, Any]  # yields Tensor or Final(Tensor)
Fuser = Callable[[list], StageGen]  # parts of one batch -> a StageGen returning their results


class Final:
    """A yielded stage marked last: after its collective the generator returns."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def unwrap(stage: Any) -> tuple[torch.Tensor, bool]:
    """(tensor, whether it is the last stage) of a yielded stage."""
    if isinstance(stage, Final):
        return stage.tensor, True
    return stage, False


def fuse(gens: Sequence[StageGen]) -> StageGen:
    """Drive several StageGens as one: stage by stage, their tensors of one dtype and device
    concatenated into one collective; returns the list of their results.

    The tensors of a stage go in generator order, one collective per (dtype, device) in order
    of first appearance, so every rank builds the same messages. A stage is marked Final only
    when every generator still running marked its own so. A lone tensor travels in place.
    """
    results: list[Any] = [None] * len(gens)
    pending: dict[int, tuple[torch.Tensor, bool]] = {}
    for i, gen in enumerate(gens):
        try:
            pending[i] = unwrap(next(gen))
        except StopIteration as stop:
            results[i] = stop.value
    while pending:
        groups: dict[tuple, list[int]] = {}
        for i, (t, _) in pending.items():
            groups.setdefault((t.dtype, t.device), []).append(i)
        final = all(f for _, f in pending.values())
        reduced: dict[int, torch.Tensor] = {}
        for g, members in enumerate(groups.values()):
            parts = [pending[i][0] for i in members]
            buf = parts[0] if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])
            out = yield (Final(buf) if final and g == len(groups) - 1 else buf)
            if len(parts) == 1:
                reduced[members[0]] = out
                continue
            for i, piece in zip(members, out.split([t.numel() for t in parts])):
                reduced[i] = piece.view(pending[i][0].shape)
        nxt = {}
        for i in pending:
            try:
                nxt[i] = unwrap(gens[i].send(reduced[i]))
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results


class StagesOp:
    """One queued multi-stage op: `part` is what its batch's `fuser` takes for it.

    Ops with the same fuser and device may be fused into one batch (`plan_batches`);
    `nbytes` is the dense FP32 size of what it carries, which the fusion threshold counts;
    `close`: this op ends a run of stage ops (a step's last bucket), so its batch is agreed at
    once rather than waiting for more.
    """

    __slots__ = ("seq", "name", "part", "fuser", "device", "fut", "key", "nbytes", "ready",
                 "close")

    def __init__(self, seq: int, name: str, part: Any, fuser: Fuser, device: torch.device,
                 fut: torch.futures.Future, key: Hashable = None, nbytes: int = 0,
                 ready: Any = None, close: bool = True) -> None:
        self.seq = seq
        self.name = name
        self.part = part
        self.fuser = fuser
        self.device = device
        self.fut = fut
        self.key = key
        self.nbytes = nbytes
        self.ready = ready  # CUDA: streams.mark() of the submitting thread's stream
        self.close = close

    @property
    def fingerprint(self) -> int:
        """What must match across ranks for a stage op: its name, size and device type."""
        return mix(mix(name_id("stages:" + self.name), self.nbytes), name_id(self.device.type))

    def describe(self) -> str:
        return f"#{self.seq} {self.name} ({self.nbytes} dense bytes, {self.device.type})"


def plan_batches(ops: Sequence[StagesOp], threshold: int) -> list[list[StagesOp]]:
    """Cut an agreed run of stage ops into batches: consecutive ops of one fuser and device,
    a batch closed once it holds `threshold` dense bytes (0: every op alone).

    A pure function of the agreed run, so every rank fuses the same ops.
    """
    out: list[list[StagesOp]] = []
    cur: list[StagesOp] = []
    size = 0
    for op in ops:
        if cur and (size >= threshold or op.fuser != cur[0].fuser or op.device != cur[0].device):
            out.append(cur)
            cur, size = [], 0
        cur.append(op)
        size += op.nbytes
    if cur:
        out.append(cur)
    return out


def drive(gen: StageGen, allreduce_sum: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run one stage generator to completion, summing each yielded tensor in place."""
    try:
        tensor, _ = unwrap(next(gen))
        while True:
            allreduce_sum(tensor)
            tensor, _ = unwrap(gen.send(tensor))
    except StopIteration as stop:
        return stop.value


def drive_lockstep(gens: Sequence[StageGen]) -> list[torch.Tensor]:
    """Simulate len(gens) ranks in one process: every stage is summed across all generators.

    Each rank's yielded tensor is replaced in place by the sum over ranks, as a SUM allreduce
    would; the ranks must yield tensors of equal shape and dtype at every stage.
    """
    results: list[torch.Tensor | None] = [None] * len(gens)
    pending = {}
    for i, gen in enumerate(gens):
        try:
            pending[i] = unwrap(next(gen))[0]
        except StopIteration as stop:
            results[i] = stop.value
    while pending:
        if len(pending) != len(gens):
            raise RuntimeError(
                f"drive_lockstep: ranks {sorted(pending)} yielded a stage that ranks "
                f"{sorted(set(range(len(gens))) - set(pending))} did not: a collective mismatch"
            )
        shapes = {(tuple(t.shape), t.dtype) for t in pending.values()}
        if len(shapes) != 1:
            raise RuntimeError(f"drive_lockstep: ranks yielded different tensors {shapes}")
        # Sum in float64 for float inputs is *not* what a transport does; sum in the wire dtype
        # in rank order, as gloo's ring does for 2 ranks, to keep rounding honest.
        total = torch.zeros_like(next(iter(pending.values())))
        for i in sorted(pending):
            total += pending[i]
        nxt = {}
        for i in sorted(pending):
            pending[i].copy_(total)
            try:
                nxt[i] = unwrap(gens[i].send(pending[i]))[0]
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results  # type: ignore[return-value]
