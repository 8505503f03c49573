"""hvd.allreduce and hvd.grouped_allreduce in their Horovod forms (new tensor, async handle,
in place), and their autograd functions."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradientflow.horovod.basics import ProcessSet, global_process_set
from gradientflow.horovod.compression import Compression
from gradientflow.horovod.ops.handles import (_check_compression, _check_tensor, _claim, _group,
                                              _label, _naming, _new_handle, _now, _scale_)
from gradientflow.horovod.ops.reduce_op import _TORCH_OP, Average, ReduceOp, _resolve_op


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
