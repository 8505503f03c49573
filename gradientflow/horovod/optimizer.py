"""hvd.DistributedOptimizer: Horovod's signature over gradientflow.optim.DistributedOptimizer.

This module only translates: Horovod's compressors, ops, groups and process sets into the
options of GradientFlow's optimizer, which overlaps the averaging with backward.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

from gradientflow.horovod.basics import ProcessSet, global_process_set
from gradientflow.horovod.compression import Compression
from gradientflow.horovod.ops.reduce_op import _ADASUM, Adasum, Average, ReduceOp, Sum

__all__ = ["DistributedOptimizer"]


def _compression_arg(compression):
    """The gradientflow.optim `compression` argument a Horovod compressor stands for (None or a
    CompressionConfig): each compressor class says which (its `config()`)."""
    if compression is None:
        return None
    config = getattr(compression, "config", None) if isinstance(compression, type) else None
    if config is None:
        raise ValueError(f"compression={compression!r} is not offered by "
                         "hvd.DistributedOptimizer: use hvd.Compression.none, "
                         "hvd.Compression.fp16 or a gradientflow method (hvd.Compression.csc, "
                         "hvd.Compression.powersgd, ...); a custom Compressor needs its own "
                         "method registered in gradientflow.compression")
    return config()


def _check_named(named_parameters, optimizer) -> list:
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         "duplicates: %s" % ", ".join(dups))
    named_ids = {id(v) for _, v in named}
    unnamed = [id(v) for g in optimizer.param_groups for v in g["params"]
               if id(v) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named. Python object ids: %s"
                         % ", ".join(str(i) for i in unnamed))
    return named


def _partition_bytes(groups, optimizer) -> int | None:
    """groups=N: N partitions of equal bytes; a list of lists is checked, then by bytes too."""
    if groups is None:
        return None
    if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return None
    total = sum(p.numel() * p.element_size() for g in optimizer.param_groups
                for p in g["params"] if p.requires_grad)
    return max(1, math.ceil(total / groups))


def _local(optimizer):
    """`optimizer` itself, with the distributed optimizer's synchronize() and
    skip_synchronize(), which have nothing to do on a rank outside the process set."""
    optimizer.synchronize = lambda: None
    optimizer.skip_synchronize = contextlib.nullcontext
    return optimizer


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap `optimizer` so that step() applies gradients averaged over the set (Horovod's API).

    Args:
        optimizer: any torch.optim optimizer; the result is an instance of its class.
        named_parameters: model.named_parameters(); names must be unique and cover every
            parameter the optimizer updates.
        compression: hvd.Compression.none (default), .fp16, .csc (GradientFlow's
            coarse-grained sparse communication, with error feedback), or any other
            gradientflow method by name (.powersgd, with .configure(rank=4)). CSC's momentum
            correction applies a torch.optim.SGD's momentum and weight decay in the compressor,
            read at every step; another optimizer needs
            hvd.Compression.csc.configure(momentum_correction=False).
        backward_passes_per_step: backward passes accumulated locally before each step.
        op: hvd.Average (default) or hvd.Sum.
        gradient_predivide_factor: Average only: scale by 1/f before the sum, f/size after.
        num_groups: deprecated, as in Horovod: use groups.
        groups: an integer N cuts the gradients into N partitions of equal bytes, each one
            message; a list of lists of parameters is validated and then cut by bytes too.
        sparse_as_dense: densify sparse gradients before averaging.
        process_set: average over this set's ranks only; on a rank outside the set the
            optimizer is returned as it is (it steps on its own gradients), as in Horovod.

    Example::

        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=hvd.Compression.fp16)
    """
    from gradientflow.optim import DistributedOptimizer as _GFOptimizer
    from gradientflow.optim import Average as _GFAverage, Sum as _GFSum

    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError(_ADASUM)
    if op not in (Average, Sum):
        name = ReduceOp(op).name if op in set(ReduceOp) else repr(op)
        raise ValueError(f"op={name} is not offered by hvd.DistributedOptimizer: gradients "
                         "are combined with hvd.Average or hvd.Sum")
    if not isinstance(process_set, ProcessSet):
        raise ValueError("process_set must be an hvd.ProcessSet")
    group = process_set.group()
    if not process_set.included():
        # Horovod's: a rank outside the set averages nothing; it steps on its own gradients.
        return _local(optimizer)
    if named_parameters is not None:
        named_parameters = _check_named(named_parameters, optimizer)
    comp = _compression_arg(compression)
    if comp is not None:
        # A method that applies momentum (CSC under momentum correction) applies the optimizer's
        # SGD settings in the compressor: refuse what it cannot reproduce here, in Horovod's
        # own spelling of the fix.
        from gradientflow.compression.momentum import check_optimizer

        check_optimizer(comp, optimizer, "hvd.DistributedOptimizer",
                        off="compression=hvd.Compression.csc.configure(momentum_correction=False)")
    kwargs = {}
    partition = _partition_bytes(groups, optimizer)
    if partition is not None:
        kwargs["partition_bytes"] = partition
    return _GFOptimizer(optimizer, named_parameters=named_parameters,
                        compression=comp,
                        backward_passes_per_step=backward_passes_per_step,
                        op=_GFAverage if op == Average else _GFSum,
                        gradient_predivide_factor=gradient_predivide_factor,
                        process_group=group, sparse_as_dense=bool(sparse_as_dense), **kwargs)
