"""Horovod's tensor collectives (hvd.allreduce and friends) on torch.distributed.

Each collective has Horovod's three forms where Horovod has them: `op(...)` returns a new tensor
and is differentiable, `op_async(...)` returns an integer handle for poll()/synchronize(), and
`op_(...)` / `op_async_(...)` write into the input (allreduce, grouped_allreduce, broadcast:
the other collectives change the shape, so Horovod has no in-place form of them either).

Collectives run on the process set's torch.distributed group; on a gradientflow group a small
async allreduce is fused with its neighbours (lazy allreduce) until a synchronize() needs it.
Unlike Horovod, which matches collectives across ranks by name, they match by call order, as in
torch.distributed: every rank must issue the same collectives in the same order. A gradientflow
group checks every call on every rank before its data moves, so ranks that differ in the
dtype, a dimension, the root or the op get an error (RuntimeError) and no wrong data. Names
are used as Horovod uses them on one rank: a name still in use by an unfinished operation is
refused (ValueError), and errors name the tensor.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import numbers
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from gradientflow.errors import CollectiveMismatchError, EngineError
from gradientflow.horovod import basics
from gradientflow.horovod.basics import HorovodInternalError, ProcessSet, global_process_set
from gradientflow.horovod.compression import Compression

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
           "broadcast_async_", "alltoall", "alltoall_async", "sparse_allreduce_async",
           "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "poll", "synchronize", "join", "barrier"]


class ReduceOp(enum.IntEnum):
    """How a reduction combines the ranks' tensors (Horovod's hvd.Average, hvd.Sum, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product

# Average travels as a sum and is divided here, after the sum (Horovod's order for postscale).
_TORCH_OP = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
# torch 2.14's name for a reduce-scatter into one tensor; before it, reduce_scatter_tensor.
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ADASUM = ("Adasum is not offered by gradientflow.horovod: use op=hvd.Average (with "
           "gradient_predivide_factor to split the averaging) or op=hvd.Sum")


def _resolve_op(op, average):
    """Horovod's rule for the deprecated `average` flag beside `op`."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
    elif average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    else:
        op = Average
    return _check_op(op)


def _check_op(op) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op={op!r} is not a Horovod reduce op: use hvd.Average, hvd.Sum, "
                         "hvd.Min, hvd.Max or hvd.Product") from None
    if op is Adasum:
        raise NotImplementedError(_ADASUM)
    return op


# ---------------------------------------------------------------------------------- handles
class _Pending:
    """One async operation: its torch Works, and what turns their result into the output."""

    def __init__(self, works: list, finish: Callable[[], Any], keep: Any = None,
                 label: str = "", names: tuple = ()) -> None:
        self.works = works
        self.finish = finish
        self.keep = keep  # the input, alive until synchronize (as Horovod's handle map does)
        self.futures: Optional[list] = None
        self.label = label  # "hvd.allreduce of tensor 'x'", for errors
        self.names = names  # the (process set, name) keys it holds until synchronize

    def done(self) -> bool:
        if self.futures is None:
            # Asked for on first use, not at launch: a fused allreduce's future closes its batch.
            self.futures = [w.get_future() for w in self.works]
        return all(f.done() for f in self.futures)


_handles: dict[int, _Pending] = {}
_next_handle = itertools.count(1)
# (process set id, name) -> the handle of the operation that uses the name (Horovod's tensor
# table: a name is refused while an operation of that name is unfinished on this rank).
_names: dict[tuple, int] = {}


def _label(op_name: str, name: Any) -> str:
    return f"hvd.{op_name}" + (f" of tensor {name!r}" if name is not None else "")


def _claim(op_name: str, name: Any, process_set: ProcessSet) -> tuple:
    """The name key of a new operation; ValueError if an unfinished one uses the name."""
    if name is None:
        return ()
    key = (process_set.process_set_id, str(name))
    h = _names.get(key)
    p = _handles.get(h) if h is not None else None
    if p is not None and not p.done():
        raise ValueError(f"{_label(op_name, name)}: a collective named {str(name)!r} is still "
                         f"in progress on rank {basics.rank()} (handle {h}); Horovod refuses a "
                         "second one with the same name. Synchronize the first, or name this "
                         "one differently.")
    return (key,)


@contextlib.contextmanager
def _naming(op_name: str, name: Any) -> Iterator[None]:
    """Errors raised at the call name the Horovod op and the tensor."""
    try:
        yield
    except (CollectiveMismatchError, EngineError) as exc:
        raise _renamed(exc, _label(op_name, name)) from exc


def _renamed(exc: BaseException, label: str) -> BaseException:
    """`exc` as the same type, its message led by `label` (what refused it is kept)."""
    try:
        new = type(exc)(f"{label}: {exc}")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return exc
    new.refused = getattr(exc, "refused", None)
    return new


def _new_handle(works: list, finish: Callable[[], Any], keep: Any = None, label: str = "",
                names: tuple = ()) -> int:
    h = next(_next_handle)
    _handles[h] = _Pending([w for w in works if w is not None], finish, keep, label, names)
    for key in names:
        _names[key] = h
    return h


def _merge(handles: list, label: str = "", names: tuple = ()) -> int:
    """One handle for several: its works are all of theirs; its output, the list of theirs."""
    parts = [_handles.pop(h) for h in handles]
    label = label or (parts[0].label if parts else "")
    return _new_handle([w for p in parts for w in p.works], lambda: [p.finish() for p in parts],
                       [p.keep for p in parts], label, names)


def poll(handle: int) -> bool:
    """Return whether the operation behind `handle` finished (synchronize() won't block)."""
    p = _handles.get(handle)
    if p is None:
        raise ValueError(f"poll: handle {handle} was not created or has been cleared (by "
                         "synchronize)")
    return p.done()


def synchronize(handle: int):
    """Wait for the operation behind `handle`; return its output (None for an unknown handle).

    A failure (ranks that issued it differently, a peer that died, a timeout) is raised as
    HorovodInternalError (a RuntimeError), naming the op and the tensor.
    """
    p = _handles.pop(handle, None)
    if p is None:
        return None
    for key in p.names:
        if _names.get(key) == handle:
            del _names[key]
    try:
        for w in p.works:
            w.wait()
    except (RuntimeError, dist.DistBackendError) as exc:
        raise HorovodInternalError(f"{p.label}: {exc}" if p.label else exc) from exc
    return p.finish()


# ---------------------------------------------------------------------------------- helpers
def _now(process_set: ProcessSet, start: Callable[[], int]):
    """Issue allreduces with `start()` and wait for them: on a gradientflow group they are
    agreed as one batch once issued, so ranks that issued them differently get the error and
    the job goes on (backend.api.waited)."""
    from gradientflow.backend.api import waited

    member = (isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
              and process_set.included())
    with waited(process_set.group() if member else None):
        handle = start()
    return synchronize(handle)


def _group(process_set: ProcessSet, op_name: str):
    """(torch group, set size, rank in set) of a registered set this process belongs to."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{op_name}: process_set must be an hvd.ProcessSet, got "
                         f"{type(process_set).__name__}")
    basics.size()  # raises "Horovod has not been initialized; use hvd.init()."
    group = process_set.group()  # raises for a set that is not registered
    if not process_set.included():
        raise ValueError(f"{op_name}: Rank {basics.rank()} is not a member of the provided "
                         f"process set {process_set}.")
    return group, process_set.size(), process_set.rank()


def _check_tensor(tensor, op_name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op_name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _scale_(t: torch.Tensor, factor: float) -> None:
    """Multiply in place; integers through float64, truncated, as Horovod scales them."""
    if factor == 1.0:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.to(torch.float64) * factor).to(t.dtype))


def _launch_allreduce(buf: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                      process_set: ProcessSet):
    """Start the allreduce of `buf` in place; return (work, finish -> buf)."""
    group, n, _ = _group(process_set, "allreduce")
    _scale_(buf, prescale)
    work = dist.all_reduce(buf, op=_TORCH_OP[op], group=group, async_op=True)

    def finish():
        _scale_(buf, postscale / n if op is Average else postscale)
        return buf

    return work, finish


def _allreduce_handle(tensor, output, op, prescale, postscale, process_set,
                      name=None) -> int:
    _check_tensor(tensor, "allreduce")
    names = _claim("allreduce", name, process_set)
    if output is not tensor:
        output.copy_(tensor)
    with _naming("allreduce", name):
        work, finish = _launch_allreduce(output, op, prescale, postscale, process_set)
    return _new_handle([work], finish, tensor, _label("allreduce", name), names)


# ---------------------------------------------------------------------------------- allreduce
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` over the set into a new tensor; return a handle.

    op: hvd.Average (default), Sum, Min, Max or Product; `average` is deprecated. Integer
    tensors are averaged and scaled in float64 and truncated, as in Horovod.
    """
    op = _resolve_op(op, average)
    return _allreduce_handle(tensor, torch.empty_like(tensor), op, prescale_factor,
                             postscale_factor, process_set, name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` over the set in place; return a handle."""
    op = _resolve_op(op, average)
    return _allreduce_handle(tensor, tensor, op, prescale_factor, postscale_factor, process_set,
                             name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the set in place and return it."""
    return _now(process_set, lambda: allreduce_async_(tensor, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set))


class _Allreduce(torch.autograd.Function):
    """Differentiable allreduce: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set, name):
        ctx.args = (op, prescale, postscale, process_set)
        return _now(process_set, lambda: _allreduce_handle(
            tensor, torch.empty_like(tensor), op, prescale, postscale, process_set, name))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        out = _now(process_set, lambda: _allreduce_handle(
            grad.contiguous(), torch.empty_like(grad), op, prescale, postscale, process_set))
        return out, None, None, None, None, None


def _check_compression(compression, op_name: str) -> None:
    if getattr(compression, "tensor_level", True) is False:
        raise ValueError(f"{op_name}: compression={compression.__name__} keeps state across "
                         "steps (a residual) agreed with the other ranks, so it compresses "
                         "gradients only: pass "
                         "it to hvd.DistributedOptimizer, or use Compression.fp16 here")


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """Return `tensor` reduced over the set (a new tensor; differentiable).

    compression: Compression.none or Compression.fp16 (the wire carries float16).

    Example::

        >>> avg = hvd.allreduce(torch.tensor([hvd.rank()], dtype=torch.float32))
    """
    op = _resolve_op(op, average)
    _check_compression(compression, "allreduce")
    payload, cctx = compression.compress(tensor)
    out = _Allreduce.apply(payload, op, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, cctx)


# -------------------------------------------------------------------------- grouped allreduce
def _grouped_handle(tensors, outputs, op, prescale, postscale, process_set, name=None) -> int:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("grouped_allreduce: tensors must be a non-empty list of tensors")
    names = _claim("grouped_allreduce", name, process_set)
    works, finishes = [], []
    with _naming("grouped_allreduce", name):
        for t, out in zip(tensors, outputs):
            _check_tensor(t, "grouped_allreduce")
            if out is not t:
                out.copy_(t)
            # Issued back to back: on a gradientflow group they fuse into one message.
            w, f = _launch_allreduce(out, op, prescale, postscale, process_set)
            works.append(w)
            finishes.append(f)
    return _new_handle(works, lambda: [f() for f in finishes], list(tensors),
                       _label("grouped_allreduce", name), names)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors (one fused operation); return a handle."""
    op = _resolve_op(op, average)
    return _grouped_handle(tensors, [torch.empty_like(t) for t in tensors], op,
                           prescale_factor, postscale_factor, process_set, name)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors in place; return a handle."""
    op = _resolve_op(op, average)
    return _grouped_handle(tensors, tensors, op, prescale_factor, postscale_factor, process_set,
                           name)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    """Reduce a list of tensors in place and return them."""
    return _now(process_set, lambda: grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_now(process_set, lambda: _grouped_handle(
            list(tensors), [torch.empty_like(t) for t in tensors], op, prescale, postscale,
            process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        grads = [g.contiguous() for g in grads]
        out = _now(process_set, lambda: _grouped_handle(
            grads, [torch.empty_like(g) for g in grads], op, prescale, postscale, process_set))
        return (None, None, None, None, *out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    """Return each tensor of the list reduced over the set (new tensors; differentiable)."""
    op = _resolve_op(op, average)
    _check_compression(compression, "grouped_allreduce")
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, process_set,
                                   *[p for p, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


# ---------------------------------------------------------------------------------- allgather
def _first_dims(n0: int, group, n: int) -> list[int]:
    mine = torch.tensor([n0], dtype=torch.int64)
    dims = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(dims, mine, group=group)
    return [int(d) for d in dims]


def _allgather_handle(tensor, process_set, name=None) -> int:
    _check_tensor(tensor, "allgather")
    group, n, _ = _group(process_set, "allgather")
    names = _claim("allgather", name, process_set)
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor
    with _naming("allgather", name):
        dims = _first_dims(t.shape[0], group, n)
        top = max(dims)
        # Ranks may differ in the first dimension: send rows padded to the longest, trim after.
        send = t if t.shape[0] == top else torch.cat(
            [t, t.new_zeros((top - t.shape[0],) + tuple(t.shape[1:]))])
        recv = [torch.empty_like(send) for _ in range(n)]
        work = dist.all_gather(recv, send.contiguous(), group=group, async_op=True)
    return _new_handle([work], lambda: torch.cat([r[:d] for r, d in zip(recv, dims)]), tensor,
                       _label("allgather", name), names)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's `tensor` along dimension 0; return a handle.

    The first dimension may differ between ranks; the other dimensions must agree.
    """
    return _allgather_handle(tensor, process_set, name)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set, name):
        ctx.process_set = process_set
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return synchronize(_allgather_handle(tensor, process_set, name))

    @staticmethod
    def backward(ctx, grad):
        # Horovod: the gradient is averaged over the set, then each rank keeps its own rows.
        ps = ctx.process_set
        group, n, me = _group(ps, "allgather")
        reduced = synchronize(_allreduce_handle(grad.contiguous(), torch.empty_like(grad),
                                                Average, 1.0, 1.0, ps))
        dims = _first_dims(ctx.rows, group, n)
        start = sum(dims[:me])
        return reduced.narrow(0, start, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return every rank's `tensor` concatenated along dimension 0 (differentiable)."""
    return _Allgather.apply(tensor, process_set, name)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering each tensor of a list; return a handle."""
    names = _claim("grouped_allgather", name, process_set)
    return _merge([_allgather_handle(t, process_set) for t in tensors],
                  _label("grouped_allgather", name), names)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """Return each tensor of the list allgathered (differentiable)."""
    return [allgather(t, name, process_set) for t in tensors]


# ---------------------------------------------------------------------------------- broadcast
def _broadcast_handle(tensor, output, root_rank, process_set, name=None) -> int:
    _check_tensor(tensor, "broadcast")
    group, _, _ = _group(process_set, "broadcast")
    ranks = process_set.ranks
    if not isinstance(root_rank, int) or root_rank not in ranks:
        raise ValueError(f"broadcast: root_rank={root_rank!r} is not a rank of the process "
                         f"set {ranks} (root_rank is a global rank, as in Horovod)")
    names = _claim("broadcast", name, process_set)
    if output is not tensor:
        output.copy_(tensor)
    with _naming("broadcast", name):
        work = dist.broadcast(output, src=root_rank, group=group, async_op=True)
    return _new_handle([work], lambda: output, tensor, _label("broadcast", name), names)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying root_rank's `tensor` into a new tensor on every rank; return a handle."""
    return _broadcast_handle(tensor, torch.empty_like(tensor), root_rank, process_set, name)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting `tensor` with root_rank's, in place; return a handle."""
    return _broadcast_handle(tensor, tensor, root_rank, process_set, name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name):
        ctx.args = (root_rank, process_set)
        return synchronize(_broadcast_handle(tensor, torch.empty_like(tensor), root_rank,
                                             process_set, name))

    @staticmethod
    def backward(ctx, grad):
        # Horovod: the averaged gradient flows back to the root only.
        root_rank, ps = ctx.args
        reduced = synchronize(_allreduce_handle(grad.contiguous(), torch.empty_like(grad),
                                                Average, 1.0, 1.0, ps))
        if basics.rank() != root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return root_rank's `tensor` on every rank (a new tensor; differentiable)."""
    return _Broadcast.apply(tensor, root_rank, process_set, name)


# ---------------------------------------------------------------------------------- alltoall
def _split_sizes(splits) -> list[int]:
    """Horovod's splits as a list of ints: a tensor of integers, or a sequence of ints; a
    tensor of another dtype (float) is refused, as Horovod refuses it."""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or (
                splits.dtype == torch.bool):
            raise ValueError(f"alltoall: splits is a {splits.dtype} tensor; pass a tensor of "
                             "integers (torch.int32, as Horovod's)")
        return [int(v) for v in splits.reshape(-1).tolist()]
    values = list(splits)
    bad = [v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool)]
    if bad:
        raise ValueError(f"alltoall: splits holds {bad[0]!r} ({type(bad[0]).__name__}); pass "
                         "whole numbers of rows (ints, or a tensor of integers)")
    return [int(v) for v in values]


def _alltoall_handle(tensor, splits, process_set, name=None) -> int:
    _check_tensor(tensor, "alltoall")
    group, n, _ = _group(process_set, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall: tensor must have at least one dimension (rows are split)")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n != 0:
            raise ValueError("splits not provided, but first dimension of tensor is not an "
                             "even multiple of the number of workers.")
        send_splits = [rows // n] * n
    else:
        send_splits = _split_sizes(splits)
        if len(send_splits) != n:
            raise ValueError("Number of entries in splits does not equal number of workers.")
        if any(s < 0 for s in send_splits):
            raise ValueError(f"alltoall: splits {send_splits} must be >= 0")
        if sum(send_splits) > rows:
            raise ValueError("Sum of splits entries is greater than the first dimension of "
                             "tensor.")
    names = _claim("alltoall", name, process_set)
    with _naming("alltoall", name):
        recv = torch.empty(n, dtype=torch.int64)
        dist.all_to_all_single(recv, torch.tensor(send_splits, dtype=torch.int64), group=group)
        recv_splits = recv.tolist()
        inp = tensor[:sum(send_splits)].contiguous()
        out = tensor.new_empty((sum(recv_splits),) + tuple(tensor.shape[1:]))
        work = dist.all_to_all_single(out, inp, output_split_sizes=recv_splits,
                                      input_split_sizes=send_splits, group=group, async_op=True)
    received = torch.tensor(recv_splits, dtype=torch.int32)
    return _new_handle([work], lambda: (out, received), tensor, _label("alltoall", name), names)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending splits[i] rows of `tensor` to rank i; return a handle.

    synchronize() returns (output, received_splits), as in Horovod.
    """
    return _alltoall_handle(tensor, splits, process_set, name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set, name):
        out, received = synchronize(_alltoall_handle(tensor, splits, process_set, name))
        ctx.args = (received, process_set)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        received, ps = ctx.args
        back, _ = synchronize(_alltoall_handle(grad.contiguous(), received, ps))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[i] rows of `tensor` to rank i (equal parts if None); return what arrived.

    Returns the gathered rows, and with `splits` given also the rows received from each rank
    (an int32 tensor), as in Horovod. Differentiable.
    """
    out, received = _Alltoall.apply(tensor, splits, process_set, name)
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------- sparse allreduce
def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO `tensor` over the set; return a function that waits and
    returns the result (a sparse tensor), as Horovod's does.

    The indices and values of every rank are allgathered (ranks may hold different numbers of
    entries) and the result holds them all, uncoalesced; op hvd.Average divides the values by
    the set's size, hvd.Sum keeps them.
    """
    op = _check_op(op)
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async: op must be hvd.Average or hvd.Sum")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise ValueError("sparse_allreduce_async: expected a sparse COO tensor, got "
                         f"{tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor)}")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # Rows of (index...) per entry: allgather concatenates along the first dimension.
    indices = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values().contiguous(), name=f"{name}.values",
                             process_set=process_set)
    size = process_set.size()

    def handle():
        vals = synchronize(values)
        idx = synchronize(indices)
        if op is Average:
            vals = vals / size
        return torch.sparse_coo_tensor(idx.t(), vals, t.size())

    return handle


# ---------------------------------------------------------------------------- reducescatter
def _rows_of(rows: int, n: int) -> list[int]:
    """Horovod's cut: the first rows % n ranks get one row more."""
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def _reducescatter_handle(tensor, op, prescale, postscale, process_set, name=None) -> int:
    _check_tensor(tensor, "reducescatter")
    if op not in (Average, Sum):
        raise ValueError("Reducescatter currently only supports AVERAGE and SUM.")
    group, n, me = _group(process_set, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: tensor must have at least one dimension (rows are "
                         "scattered)")
    names = _claim("reducescatter", name, process_set)
    counts = _rows_of(tensor.shape[0], n)
    top = counts[0]
    tail = tuple(tensor.shape[1:])
    # Every rank's part padded to the longest, so one equal-sized reduce-scatter carries it.
    padded = tensor.new_zeros((n * top,) + tail)
    start = 0
    for i, c in enumerate(counts):
        padded[i * top:i * top + c] = tensor[start:start + c]
        start += c
    _scale_(padded, prescale)
    out = tensor.new_empty((top,) + tail)
    with _naming("reducescatter", name):
        work = _REDUCE_SCATTER_SINGLE(out, padded, op=_TORCH_OP[op], group=group,
                                      async_op=True)

    def finish():
        mine = out[:counts[me]]
        _scale_(mine, postscale / n if op is Average else postscale)
        return mine

    return _new_handle([work], finish, tensor, _label("reducescatter", name), names)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducing `tensor` over the set and keeping this rank's rows; return a handle."""
    return _reducescatter_handle(tensor, _check_op(op), prescale_factor, postscale_factor,
                                 process_set, name)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, process_set, prescale, postscale, name):
        ctx.args = (op, process_set, prescale * postscale)
        return synchronize(_reducescatter_handle(tensor, op, prescale, postscale, process_set,
                                                 name))

    @staticmethod
    def backward(ctx, grad):
        op, ps, factor = ctx.args
        grad = grad.clone()
        # Horovod's rule: with Sum the gathered gradient is scaled by the set's size.
        _scale_(grad, factor * (ps.size() if op is Sum else 1))
        return allgather(grad, process_set=ps), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Return this rank's rows of `tensor` reduced over the set (differentiable).

    Rank i gets rows [sum(c[:i]), sum(c[:i+1])) with c the rows cut as evenly as possible,
    the first ranks taking one more (Horovod's cut).
    """
    op = _check_op(op)
    _check_compression(compression, "reducescatter")
    payload, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(payload, op, process_set, prescale_factor, postscale_factor, name)
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reduce-scattering each tensor of a list; return a handle."""
    op = _check_op(op)
    names = _claim("grouped_reducescatter", name, process_set)
    return _merge([_reducescatter_handle(t, op, prescale_factor, postscale_factor, process_set)
                   for t in tensors], _label("grouped_reducescatter", name), names)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """Return each tensor of the list reduce-scattered (differentiable)."""
    return [reducescatter(t, name, compression, op, process_set, prescale_factor,
                          postscale_factor) for t in tensors]


# ---------------------------------------------------------------------------------- control
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
