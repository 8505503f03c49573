"""Horovod's broadcast_parameters and broadcast_optimizer_state: start every rank from root's
state."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def _named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        items = []
        for i, p in enumerate(params):
            items.append(p if isinstance(p, tuple) else (str(i), p))
    else:
        raise ValueError("broadcast_parameters: params must be a state_dict (a mapping), "
                         "model.named_parameters() or a list of tensors; got "
                         f"{type(params).__name__}")
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError("broadcast_parameters: expected (name, tensor) pairs, got "
                             f"{type(item).__name__}")
        if isinstance(item[1], torch.Tensor):
            out.append((str(item[0]), item[1]))
    return out


def broadcast_parameters(params, root_rank: int = 0, process_group=None) -> None:
    """Overwrite every rank's tensors in place with root_rank's (parameters and buffers).

    Args:
        params: model.state_dict() (buffers too), model.named_parameters() or a list of tensors.
        root_rank: the rank whose values everyone gets.
        process_group: the group (default: the world group).

    Example::

        >>> gradientflow.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # one process: already everyone's values
    world = dist.get_world_size(process_group)
    if not 0 <= root_rank < world:
        raise ValueError(f"broadcast_parameters: root_rank={root_rank} is not a rank of this "
                         f"group of {world}; use 0..{world - 1}")
    src = dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank
    # Sorted by name: a state_dict and named_parameters list the same names in the same order on
    # every rank of the same model, and sorting makes a dict built in another order agree too.
    with torch.no_grad():
        for name, t in sorted(_named_tensors(params), key=lambda kv: kv[0]):
            data = t.detach()
            if not data.is_contiguous():
                tmp = data.contiguous()
                dist.broadcast(tmp, src=src, group=process_group)
                data.copy_(tmp)
            else:
                dist.broadcast(data, src=src, group=process_group)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group=None) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters (e.g. after a resume).

    The whole state_dict travels as one object from the root and is loaded everywhere, so a rank
    whose optimizer has no state yet (no step taken) gets the root's momentum buffers too.

    Example::

        >>> gradientflow.broadcast_optimizer_state(opt, root_rank=0)
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(process_group)
    if not 0 <= root_rank < world:
        raise ValueError(f"broadcast_optimizer_state: root_rank={root_rank} is not a rank of "
                         f"this group of {world}; use 0..{world - 1}")
    src = dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank
    me = dist.get_rank(process_group)
    # Without the per-rank compression state (residuals differ per rank by design): every
    # rank keeps its own, and a rank that received root's would apply root's residual twice.
    root_state = None
    if me == root_rank:
        root_state = {k: v for k, v in optimizer.state_dict().items() if k != "gradientflow"}
    box: list[Any] = [root_state]
    dist.broadcast_object_list(box, src=src, group=process_group)
    if me != root_rank:
        optimizer.load_state_dict(box[0])
