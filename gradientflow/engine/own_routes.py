"""The launches of the eager allreduces that take a route of their own (checks.own_route).

- INBAND: the check round already summed the tensor (rounds.py adds the peers' payloads), so
  the launch only hands back a Work that is complete.
- EXCHANGE: one all-to-all of the whole tensor on the transport, the peer's then added to this
  rank's; the round before it agreed dtype and size, so the all-to-all's byte counts match.
  A compressed stage of the same dtype and size is summed the same way (swap_stage).
- CARRIED (a broadcast): the check round already copied the root's tensor (rounds.py).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import ReduceOp

from gradientflow.engine import completion
from gradientflow.engine.checks import EXCHANGE, INBAND, own_route
from gradientflow.engine.work import FutureWork, WorkOwner


def done(works: WorkOwner, seq: int, tensors: list, name: str = "all_reduce") -> FutureWork:
    """The Work of a call its round already completed (an allreduce summed, a broadcast
    copied): complete, its value the tensors."""
    fut = completion.new_source()
    fut.set_result(tensors)
    return FutureWork(fut, works, seq, name)


def launch_allreduce(route: int, chk: Any, tensors: list, opts: Any, transport: Any,
                     rank: int, works: WorkOwner, stats: Any,
                     wait: Callable[[Any], None] | None) -> Any:
    """An eager allreduce's launch once its round (`chk`) agreed it everywhere: by its own
    `route` (checks.own_route; `wait`: a synchronous call's, see exchange), or the transport's
    allreduce; its Work."""
    if route == INBAND:  # summed inside the round: nothing left to send
        stats.record_inband()
        return done(works, chk.seq, tensors)
    if route == EXCHANGE:
        stats.record_exchange(carried=chk.summed)
        if chk.summed:  # the round had room for it (rounds.py)
            return done(works, chk.seq, tensors)
        return exchange(transport, tensors[0], rank, works, chk.seq, wait)
    return transport.allreduce(tensors, opts)


def exchange(transport: Any, tensor: torch.Tensor, rank: int, works: WorkOwner, seq: int,
             wait: Callable[[Any], None] | None) -> FutureWork:
    """An allreduce of two ranks as one all-to-all of the whole tensor, the peer's added to
    this rank's (a + b on one, b + a on the other: gloo's bits).

    `wait` (a synchronous call): the transport's Work is waited here with it (rounds.wait: in
    slices, ending on the group's fault) and the Work handed back is complete; a future
    chained to the transport's would cost a thread hand-off or two on the way back.
    """
    if wait is not None:
        swap_add(transport, tensor, rank, wait)
        return done(works, seq, [tensor])
    flat = tensor.view(-1)
    theirs = torch.empty_like(flat)
    splits = _splits(rank, flat.numel())
    work = transport.alltoall_base(theirs, flat, splits, splits)

    def add(fut: torch.futures.Future) -> list:
        fut.value()  # re-raises the transport's error
        flat.add_(theirs)
        return [tensor]

    return FutureWork(work.get_future().then(add), works, seq, "all_reduce")


_LOCAL = threading.local()


def swap_add(transport: Any, tensor: torch.Tensor, rank: int,
             wait: Callable[[Any], None]) -> None:
    """The EXCHANGE route of a synchronous call: the all-to-all, waited on with `wait`, and
    the peer's tensor added to this rank's.

    The peer's tensor lands in a buffer the calling thread keeps (at most EXCHANGE_BYTES,
    the largest tensor this route takes): a block of this size fresh from the allocator may
    be new pages, faulted in while the transport receives into them.
    """
    flat = tensor.view(-1)
    nbytes = flat.numel() * flat.element_size()
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _LOCAL.buf = torch.empty(max(nbytes, 2**16), dtype=torch.uint8)
    theirs = buf[:nbytes].view(flat.dtype)
    splits = _splits(rank, flat.numel())
    try:
        wait(transport.alltoall_base(theirs, flat, splits, splits))
    except BaseException:
        _LOCAL.buf = None  # the all-to-all may still be writing into it
        raise
    flat.add_(theirs)


def swap_stage(transport: Any, tensor: torch.Tensor, rank: int, world_size: int,
               wait: Callable[[Any], None]) -> bool:
    """A compressed stage's SUM (jobs.StagesBatch) by `swap_add`, where an eager allreduce of
    its dtype and size would take a route of its own: True; False, for the transport's
    allreduce. Its size is agreed like any stage's (a function of the agreed batch), and the
    exchange is one hop each way where gloo's ring of two takes two in a row."""
    if not tensor.is_contiguous() or own_route(tensor, ReduceOp.SUM, world_size) == 0:
        return False
    swap_add(transport, tensor, rank, wait)
    return True


def _splits(rank: int, n: int) -> list[int]:
    """What rank `rank` of two sends to (and takes from) each: all of it to the other."""
    return [0, n] if rank == 0 else [n, 0]
