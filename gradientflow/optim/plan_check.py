"""The check, when a reducer is built, that every rank built the same partition plan."""
from __future__ import annotations

import json
from typing import Sequence

from gradientflow.cross_rank import GroupExchange, agree
from gradientflow.optim.plan import ParamSpec
from gradientflow.optim.reducer_options import PREFIX as _PREFIX
from gradientflow.optim.reducer_options import ReducerOptions


def plan_description(specs: Sequence[ParamSpec], options: ReducerOptions) -> str:
    """What the plan is built from and every rank must share: the trainable parameters (name,
    shape, dtype, in order) and the options that cut or order the partitions."""
    o = options
    return json.dumps({
        "parameters": [[s.name, list(s.shape), str(s.dtype)] for s in specs],
        "options": (f"partition_bytes={o.partition_bytes}, compression={o.compression}, "
                    f"backward_passes_per_step={o.backward_passes_per_step}, op={o.op}, "
                    f"priority={o.priority}")})


def _param(entry: list) -> str:
    name, shape, dtype = entry
    return f"{name!r} {tuple(shape)} {dtype}"


def check_same_everywhere(specs, options: ReducerOptions, group, rank: int, world: int) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built the same plan.

    One fixed-size allgather of a digest (cross_rank.agree); every rank's description is
    gathered only on a mismatch, which every rank sees at once.
    """
    found = agree(plan_description(specs, options), GroupExchange(group, world), rank)
    if found is None:
        return
    everyone = [json.loads(d) for d in found.descriptions]
    first = everyone[0]
    detail = ""
    for r, held in enumerate(everyone):
        d, d0 = held["parameters"], first["parameters"]
        if d != d0:
            k = next((i for i, (a, b) in enumerate(zip(d0, d)) if a != b), min(len(d), len(d0)))
            a = _param(d0[k]) if k < len(d0) else "nothing"
            b = _param(d[k]) if k < len(d) else "nothing"
            detail = (f"rank 0 has {len(d0)} trainable parameters, rank {r} has "
                      f"{len(d)}; first difference at position {k}: rank 0 {a}, rank {r} {b}")
            break
        if held["options"] != first["options"]:
            detail = f"options differ: rank 0 {first['options']}, rank {r} {held['options']}"
            break
    raise ValueError(f"{_PREFIX}: rank {rank}: the parameter list differs across "
                     f"ranks ({detail}). Build the same model on every rank and pass the "
                     "same named_parameters, in the same order, with the same options, to "
                     "DistributedOptimizer on every rank.")
