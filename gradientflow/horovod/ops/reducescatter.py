"""hvd.reducescatter and hvd.grouped_reducescatter: reduce over the set, keep this rank's rows."""
from __future__ import annotations

import torch

from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.compression import Compression
from gradientflow.horovod.ops.gather import allgather
from gradientflow.horovod.ops.handles import (_check_compression, _check_tensor, _claim, _group,
                                              _label, _merge, _naming, _new_handle, _scale_,
                                              synchronize)
from gradientflow.horovod.ops.reduce_op import (_REDUCE_SCATTER_SINGLE, _TORCH_OP, Average, Sum,
                                                _check_op)


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
