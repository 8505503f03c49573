"""Collectives that move data without reducing it: allgather, broadcast, alltoall, and the sparse
allreduce built on allgather."""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from gradientflow.horovod import basics
from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.ops.allreduce import _allreduce_handle
from gradientflow.horovod.ops.handles import (_check_tensor, _claim, _group, _label, _merge,
                                              _naming, _new_handle, synchronize)
from gradientflow.horovod.ops.reduce_op import Average, Sum, _check_op


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
