"""Horovod's start-of-training helpers: broadcast parameters, optimizer state and objects."""
from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from gradientflow.horovod import basics
from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.mpi_ops import _group

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]

try:  # Horovod pickles with cloudpickle, so lambdas and local classes travel too
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle comes with pyspark and ray
    _pickler = pickle


def broadcast_parameters(params, root_rank) -> None:
    """Overwrite every rank's tensors in place with root_rank's.

    Args:
        params: model.state_dict() (buffers too), model.named_parameters() or a list of
            tensors or of (name, tensor) pairs.
        root_rank: the rank whose values everyone gets.
    """
    from gradientflow.optim import broadcast_parameters as _broadcast

    basics.size()
    if isinstance(params, (str, bytes, torch.Tensor)) or not hasattr(params, "__iter__"):
        raise ValueError("invalid params of type: %s" % type(params))
    _broadcast(params, root_rank=root_rank)


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters (e.g. after a resume).

    `model` is accepted for Horovod's signature; the state travels as one object, so sparse
    parameters need no special case.
    """
    from gradientflow.optim import broadcast_optimizer_state as _broadcast

    basics.size()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    _broadcast(optimizer, root_rank=root_rank)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return buf.getvalue()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return root_rank's `obj` on every rank of the set (pickled with cloudpickle).

    Example::

        >>> state = hvd.broadcast_object(opt.state_dict(), root_rank=0)
    """
    group, _, _ = _group(process_set, "broadcast_object")
    if root_rank not in process_set.ranks:
        raise ValueError(f"broadcast_object: root_rank={root_rank!r} is not a rank of the "
                         f"process set {process_set.ranks}")
    box = [_dumps(obj) if basics.rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, group=group)
    return obj if basics.rank() == root_rank else pickle.loads(box[0])


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's `obj`, in rank order (pickled with cloudpickle)."""
    group, n, _ = _group(process_set, "allgather_object")
    out: list = [None] * n
    dist.all_gather_object(out, _dumps(obj), group=group)
    return [pickle.loads(b) for b in out]
