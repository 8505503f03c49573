"""The multi-stage op contract shared by compressors and the engine.

A compressed gradient bucket is one op with several collective stages (chunk norms, then the
packed chunks). Compressors express it as a generator that *yields* each tensor to be
SUM-allreduced in place and receives it back reduced; its return value is the op's result:

    def reduce(flat):                 # a StageGen
        norms = local_norms(flat)
        norms = yield norms           # every rank's norms, summed
        packed = pack(flat, select(norms))
        packed = yield packed         # every rank's packed chunks, summed
        return unpack(packed)

The engine runs every stage of one op back to back on its own thread, so two collectives of one
bucket can never interleave differently with another bucket's on different ranks. Compression
code never sees a process group; tests run N "ranks" in one process with `drive_lockstep`.
"""
from __future__ import annotations

from typing import Callable, Generator, Sequence

import torch

StageGen = Generator[torch.Tensor, torch.Tensor, torch.Tensor]


def drive(gen: StageGen, allreduce_sum: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run one stage generator to completion, summing each yielded tensor in place."""
    try:
        tensor = next(gen)
        while True:
            allreduce_sum(tensor)
            tensor = gen.send(tensor)
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
            pending[i] = next(gen)
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
                nxt[i] = gens[i].send(pending[i])
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results  # type: ignore[return-value]
