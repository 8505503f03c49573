"""hvd.join and hvd.barrier: whole-set synchronisation without a tensor result."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradientflow.errors import CollectiveMismatchError
from gradientflow.horovod import basics
from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.ops.handles import _group


def join(device=-1) -> int:
    """Wait until every rank called join(); return the rank that called it last.

    Unlike Horovod, ranks that joined do not stand in (with zeros) for the allreduces other
    ranks still issue (docs/HOROVOD.md says why): on a gradientflow group such a collective is
    refused with an error on the rank that issued it while the joined ranks wait on, as
    Horovod refuses an allgather or broadcast after a join. Give every rank the same number of
    steps (e.g. drop_last batches).
    """
    group, n, _ = _group(global_process_set, "join")
    stamp = torch.tensor([time.time(), float(basics.rank())], dtype=torch.float64)
    stamps = [torch.empty(2, dtype=torch.float64) for _ in range(n)]
    while True:
        try:
            dist.all_gather(stamps, stamp, group=group)
            break
        except CollectiveMismatchError as exc:
            # A rank that has not joined issued a collective this one takes no part in: the
            # round refused it there (that rank got the error) and here; wait on.
            if not getattr(exc, "refused", None):
                raise
    return int(max(stamps, key=lambda s: (float(s[0]), float(s[1])))[1])


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set reached this barrier."""
    group, _, _ = _group(process_set, "barrier")
    dist.barrier(group=group)
