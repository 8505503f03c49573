"""Horovod's reduce ops (hvd.Average, hvd.Sum, ...) and how each travels on torch.distributed."""
from __future__ import annotations

import enum
import warnings

import torch.distributed as dist


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
