"""The check, when a reducer is built, that every rank built the same partition plan."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradientflow.optim.plan import plan_fingerprint
from gradientflow.optim.reducer_options import PREFIX as _PREFIX
from gradientflow.optim.reducer_options import ReducerOptions


def check_same_everywhere(specs, options: ReducerOptions, group, rank: int, world: int) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built the same plan.

    One fixed-size allgather of a digest; the detailed (object) gather only on mismatch, which
    every rank sees at once, so every rank takes the same path.
    """
    o = options
    digest = plan_fingerprint(specs, f"{o.partition_bytes}|{o.compression}|"
                                     f"{o.backward_passes_per_step}|{o.op}|{o.priority}")
    mine = torch.tensor(list(digest[:16]), dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    if all(torch.equal(x, out[0]) for x in out):
        return
    desc = [(s.name, s.shape, str(s.dtype)) for s in specs]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (desc, repr(options)), group=group)
    detail = ""
    for r, (d, opts) in enumerate(everyone):
        if d != everyone[0][0]:
            k = next((i for i, (a, b) in enumerate(zip(everyone[0][0], d)) if a != b),
                     min(len(d), len(everyone[0][0])))
            a = everyone[0][0][k] if k < len(everyone[0][0]) else "nothing"
            b = d[k] if k < len(d) else "nothing"
            detail = (f"rank 0 has {len(everyone[0][0])} trainable parameters, rank {r} has "
                      f"{len(d)}; first difference at position {k}: rank 0 {a}, rank {r} {b}")
            break
        if opts != everyone[0][1]:
            detail = f"options differ: rank 0 {everyone[0][1]}, rank {r} {opts}"
            break
    raise ValueError(f"{_PREFIX}: rank {rank}: the parameter list differs across "
                     f"ranks ({detail}). Build the same model on every rank and pass the "
                     "same named_parameters, in the same order, with the same options, to "
                     "DistributedOptimizer on every rank.")
