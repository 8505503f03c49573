"""Every dtype on every collective, whatever the transport lacks (the arithmetic; the
transport adapter, adapter.py, applies it).

gloo has no kernel for int16, the unsigned types wider than a byte or the float8 types
("Invalid scalar type"), nor complex numbers in its gathers and all-to-alls; NCCL has no int16
either. Horovod takes int16 on every collective, so the transports are wrapped here:

- data movement (broadcast, gathers, scatters, all-to-alls, send/recv) carries such a tensor as
  a view of the same bytes in a type of the same width the transport has (int16 as float16,
  complex as its real pairs): nothing reads the values, so the bits arrive unchanged;
- reductions run on a wider copy (int16 and uint16 in int32, uint32 in int64) narrowed back
  when the operation completes. Narrowing wraps modulo 2**bits, which is what the native
  integer sum and product would give, and min, max and the bitwise ops are unchanged by the
  widening. uint64 reduces as int64 (the same bits, the same wrapping sum), its order mapped
  onto int64's by flipping the top bit for MIN and MAX.

float8 tensors are moved but never reduced: validate.check_reduce refuses them at the call.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import ReduceOp, Work

# A dtype the transports cannot move -> how its bytes travel (same element size).
_BITS: dict[torch.dtype, Any] = {
    torch.int16: torch.float16,
    torch.uint16: torch.float16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
    torch.complex32: torch.view_as_real,
    torch.complex64: torch.view_as_real,
    torch.complex128: torch.view_as_real,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _BITS[getattr(torch, _name)] = torch.uint8
# Integer dtypes the transports cannot reduce -> the wider dtype they are reduced in.
_WIDE: dict[torch.dtype, torch.dtype] = {torch.int16: torch.int32, torch.uint16: torch.int32,
                                         torch.uint32: torch.int64, torch.uint64: torch.int64}
NOT_REDUCED = frozenset(t for t in _BITS if t not in _WIDE and not t.is_complex)
_SIGN = -(2**63)  # int64's top bit: uint64's order onto int64's for MIN and MAX
_ORDERED = (ReduceOp.MIN, ReduceOp.MAX)

# Which arguments of each transport method hold tensors, and for reductions which of them
# are written (copied back after a widened reduction).
MOVE = {"broadcast": (0,), "allgather": (0, 1), "_allgather_base": (0, 1),
         "allgather_coalesced": (0, 1), "allgather_into_tensor_coalesced": (0, 1),
         "alltoall": (0, 1), "alltoall_base": (0, 1), "gather": (0, 1), "scatter": (0, 1),
         "send": (0,), "recv": (0,)}
REDUCE = {"allreduce": ((0,), (0,)), "allreduce_coalesced": ((0,), (0,)),
           "reduce": ((0,), (0,)), "reduce_scatter": ((0, 1), (0,)),
           "_reduce_scatter_base": ((0, 1), (0,)),
           "reduce_scatter_tensor_coalesced": ((0, 1), (0,))}


def _special(arg: Any, table: dict) -> bool:
    if isinstance(arg, torch.Tensor):
        return arg.dtype in table
    if isinstance(arg, (list, tuple)):
        if len(arg) == 1 and isinstance(arg[0], torch.Tensor):  # the usual [tensor]
            return arg[0].dtype in table
        return any(_special(a, table) for a in arg)
    return False


def _map(arg: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(arg, torch.Tensor):
        return fn(arg)
    if isinstance(arg, list):
        return [_map(a, fn) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_map(a, fn) for a in arg)
    return arg


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or a view of its bytes in a type of the same width the transports move."""
    to = _BITS.get(t.dtype)
    if to is None:
        return t
    return to(t) if callable(to) and not isinstance(to, torch.dtype) else t.view(to)


def _reduce_op(opts: Any) -> Any:
    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    return getattr(op, "op", op)


def widen(t: torch.Tensor, ordered: bool) -> torch.Tensor:
    """A copy of `t` in the dtype it is reduced in (`ordered`: for MIN or MAX)."""
    if t.dtype == torch.uint64:
        wide = t.view(torch.int64).clone()
        return wide.bitwise_xor_(_SIGN) if ordered else wide
    wide = _WIDE.get(t.dtype)
    return t if wide is None else t.to(wide)


def narrow_(out: torch.Tensor, wide: torch.Tensor, ordered: bool) -> None:
    """Write the reduced `wide` copy back into `out` (wrapping, as the native op would)."""
    if out.dtype == torch.uint64:
        out.view(torch.int64).copy_(wide.bitwise_xor(_SIGN) if ordered else wide)
    else:
        out.copy_(wide)


class NarrowedWork(Work):
    """The Work of a reduction run on wider copies: its completion writes them back into the
    caller's tensors, before wait() returns or the future's value is seen."""

    def __init__(self, inner: Any, pairs: list, ordered: bool, result: Any) -> None:
        super().__init__()
        self._inner = inner

        def finish(fut: torch.futures.Future) -> Any:
            fut.value()  # re-raises the reduction's error
            for out, wide in pairs:
                narrow_(out, wide, ordered)
            return result

        self._fut = inner.get_future().then(finish)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: D401
        """Wait for the reduction and the write-back."""
        if timeout is None:
            self._inner.wait()
        else:
            self._inner.wait(timeout)
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()


def bits_args(name: str, args: tuple) -> tuple:
    """The arguments of data-movement method `name` with every tensor of a dtype the
    transports cannot move replaced by a view of its bytes (`args` itself if there is none)."""
    indices = MOVE[name]
    n = len(args)
    for i in indices:
        if i < n and _special(args[i], _BITS):
            break
    else:
        return args
    return tuple(_map(a, as_bits) if i in indices else a for i, a in enumerate(args))


def widen_args(name: str, args: tuple) -> tuple[tuple, list, bool] | None:
    """For reduction method `name`: (its arguments on wider copies, the (tensor, copy) pairs
    to narrow back, whether the op is MIN or MAX), or None if no tensor needs widening."""
    tensors, outputs = REDUCE[name]
    n = len(args)
    for i in tensors:
        if i < n and _special(args[i], _WIDE):
            break
    else:
        return None
    opts = args[max(tensors) + 1] if len(args) > max(tensors) + 1 else None
    ordered = _reduce_op(opts) in _ORDERED
    pairs: list = []

    def wide_out(t: torch.Tensor) -> torch.Tensor:
        w = widen(t, ordered)
        pairs.append((t, w))
        return w

    staged = tuple(_map(a, wide_out if i in outputs else (lambda t: widen(t, ordered)))
                   if i in tensors else a for i, a in enumerate(args))
    return staged, pairs, ordered
