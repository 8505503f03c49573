"""Horovod's start-of-training helpers: broadcast parameters, optimizer state and objects."""
from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from gradientflow.horovod import basics
from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.ops.handles import _group

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

    As in Horovod, an optimizer with no state yet is first stepped once, on this rank alone,
    with a zero gradient for every parameter that requires one (sparse for SparseAdam, and for
    the sparse embeddings of `model` under SGD): its state then exists to be overwritten, and
    those parameters keep the zero gradient. The state then travels as one object.
    """
    from gradientflow.optim import broadcast_optimizer_state as _broadcast

    basics.size()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer, model)
    _broadcast(optimizer, root_rank=root_rank)


def _initialize_state(optimizer, model) -> None:
    """Horovod's zero step: zero gradients, then the wrapped optimizer's own step, locally."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    # A distributed optimizer's own step would average over the ranks, which only works if
    # every rank steps: the wrapped class's step runs here instead.
    local = getattr(optimizer, "_base_step", None)
    if local is not None:
        local(None)
    else:
        optimizer.step()


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
