"""A synchronous allreduce on a route of its own (checks.own_route), whole on the caller's
thread: numbered, recorded, checked in its round, summed, and handed back complete.

It is the general eager path's fast case (issue.py: a jobs.Claim that holds the queue's
floor, its round and launch on the caller's thread), taken only when the engine is idle, with
the same lock, order and rules: the call takes its sequence number and the floor under the
engine's lock, so no other round or send overlaps it, and its round refuses a mismatch on
every rank before anything is applied. What it saves is per-call Python: the signature's
fingerprint is cached per (dtype, shape, route), and no Work is made: the call returns
complete, as torch takes of a synchronous call (NCCL's return no Work either, and
torch.distributed's functions wait only on a Work they get).

`repeat` is the same call from torch's own arguments, for the backend's entry: a program
repeats a few allreduces, so what the general path works out for each call (the arguments'
checks, the route, the signature) is a function of (dtype, shape, reduce op) here, worked out
once; per call only what that key does not fix is read (one tensor, dense, contiguous, on
CPU; a synchronous call of torch's options type). Anything else is left to the general path
with nothing taken.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch._C._distributed_c10d import AllreduceOptions

from gradientflow.engine.checks import EXCHANGE, Check, refuses_only_the_call, signature

if TYPE_CHECKING:
    from gradientflow.engine.issue import IssueParts

_MAX_KEYS = 4096  # signatures cached; a program repeats a few
_STRIDED = torch.strided
# Whether this torch's AllreduceOptions carry asyncOp: where they do not, every call counts as
# asynchronous and `repeat` never applies.
_SAYS_SYNC = hasattr(AllreduceOptions(), "asyncOp")
_UNKNOWN = object()  # a signature `repeat` has not met yet


class _Call:
    """Stands in for the call's Work in the inspector's records (a stall shows on it)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


class SyncOwn:
    """The fast case of a synchronous own-route allreduce (module doc).

    `take(what)`: the next sequence number (lock held); `checking`: the sequence numbers in
    their round now (Issue.checking); `refused(seqs)`: tells the inspector; `exchange(tensor)`:
    the EXCHANGE route's data, waited on; `insp`: the inspector, or None.
    """

    def __init__(self, parts: IssueParts, take: Callable[[str], int], checking: set,
                 refused: Callable[[list], None], exchange: Callable[[torch.Tensor], None],
                 insp: Any, route_of: Callable[[list, torch.Tensor, Any], int]) -> None:
        self._parts = parts
        self._take = take
        self._checking = checking
        self._refused = refused
        self._exchange = exchange
        self._insp = insp
        # The own route the general path gives a synchronous allreduce, or 0 (Issue).
        self._route_of = route_of
        self._keys: dict = {}
        # (dtype, shape, reduce op) -> (route, what _known gives), or None where the general
        # path takes the call (repeat).
        self._repeats: dict = {}

    def forget(self) -> None:
        """Drop what was worked out per signature (the routing settings changed)."""
        self._keys.clear()
        self._repeats.clear()

    def repeat(self, tensors: list, opts: Any) -> bool:
        """A synchronous allreduce from torch's arguments (`tensors`, `opts` as the backend
        gets them), run to its end on this path: True; False, with nothing checked or taken,
        for the general path (module doc)."""
        if (len(tensors) != 1 or opts.__class__ is not AllreduceOptions or not _SAYS_SYNC
                or opts.asyncOp):
            return False
        tensor = tensors[0]
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not _STRIDED or (
                not tensor.is_cpu or not tensor.is_contiguous()):
            return False
        reduce_op = opts.reduceOp
        # hash() of a ReduceOp is its op number (PREMUL_SUM's too: never an own route).
        rk = (tensor.dtype, tensor.shape, hash(reduce_op))
        entry = self._repeats.get(rk, _UNKNOWN)
        if entry is _UNKNOWN:
            if len(self._repeats) >= _MAX_KEYS:
                self._repeats.clear()
            route = self._route_of(tensors, tensor, reduce_op)
            entry = self._repeats[rk] = (
                (route, self._known(tensors, tensor, reduce_op, route)) if route else None)
        if entry is None:
            return False
        insp = self._insp
        if insp is not None and insp.debug is not None:
            return False
        return self.run(tensors, tensor, reduce_op, entry[0], entry[1])

    def _known(self, tensors: list, tensor: torch.Tensor, reduce_op: Any,
               route: int) -> tuple:
        """The call's signature key and fingerprint, as Check computes them, and its
        (signature, hash) in the inspector's chain: functions of dtype, shape and route (own
        routes are SUMs)."""
        ck = (tensor.dtype, tensor.shape, route)
        known = self._keys.get(ck)
        if known is None:
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            key = signature("all_reduce", tensor, tensors, None, reduce_op)
            isig = self._insp.signature("all_reduce", tensor, None, reduce_op) if (
                self._insp is not None) else None
            known = self._keys[ck] = (key, Check(0, key, route=route).fingerprint, isig)
        return known

    def run(self, tensors: list, tensor: torch.Tensor, reduce_op: Any, route: int,
            known: tuple | None = None) -> bool:
        """Run the call to its end: True; False (nothing taken) when the engine is not idle,
        for the general path to queue it behind what is there. `known`: what `_known` gives
        for it, if the caller has it."""
        key, fp, isig = known or self._known(tensors, tensor, reduce_op, route)
        parts = self._parts
        queue = parts.queue
        insp = self._insp
        call = _Call() if insp is not None else None
        with parts.lock:
            if queue.issued or queue.agreed or queue.busy or queue.floor:
                return False
            seq = self._take("all_reduce")
            queue.floor = True
            self._checking.add(seq)
            parts.stats.record_eager(True)
            # Both routes offer the tensor to the round, which carries it when it has room.
            chk = Check.known(seq, key, fp, True, tensor, route)
            if insp is not None:
                insp.record_known(seq, "all_reduce", *isig, None, reduce_op, call)
        try:
            try:
                parts.rounds.own(chk)
            except Exception as exc:  # noqa: BLE001 - as Issue._settle
                if refuses_only_the_call(exc, True):
                    self._refused([seq])
                    raise
                raise parts.fail(exc) from None
            if route == EXCHANGE:
                parts.stats.record_exchange(carried=chk.summed)
                if not chk.summed:
                    self._exchange(tensor)
            else:
                parts.stats.record_inband()
        finally:
            with parts.lock:
                queue.floor = False
                self._checking.discard(seq)
                if queue.issued or queue.agreed:  # what queued behind it goes now
                    parts.cv.notify_all()
        if call is not None:
            call.done = True
        return True
