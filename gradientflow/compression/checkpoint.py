"""Checkpoints of per-rank compression state: gather every rank's shard, and pick one on resume.

Residuals differ per rank, so a checkpoint holds all of them: ``{"world_size": n, "shards":
[shard_0, ..., shard_{n-1}]}``. Resuming with the same world size gives each rank its own shard.
Resuming with another world size follows a stated policy, always with a warning:

- ``"redistribute"`` (default): every new rank gets the SUM over old ranks of each residual /
  momentum, divided by the new world size. What matters to the model is that sum (it is what
  would still have been applied), so nothing is lost and nothing is counted twice.
- ``"reset"``: start from zero residuals (drops at most a few steps' worth of small gradients).
- ``"error"``: refuse with a ValueError.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["RESIZE_POLICIES", "gather_shards", "shard_for_rank", "is_full_checkpoint"]

RESIZE_POLICIES = ("redistribute", "reset", "error")


def is_full_checkpoint(state: dict) -> bool:
    """Whether `state` holds every rank's shard (rather than one rank's)."""
    return isinstance(state, dict) and "shards" in state


def gather_shards(shard: dict, process_group=None, dst: int = 0) -> dict | None:
    """Collect every rank's shard on rank `dst` (None elsewhere); without a group, wrap this one
    shard.

    Call it on every rank of the group, as any collective.
    """
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return {"world_size": 1, "shards": [shard]}
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    cpu_shard = _to_cpu(shard)
    out = [None] * world if rank == dst else None
    dist.gather_object(
        cpu_shard,
        out,
        dst=dist.get_global_rank(process_group, dst) if process_group else dst,
        group=process_group,
    )
    return {"world_size": world, "shards": out} if rank == dst else None


def shard_for_rank(
    checkpoint: dict, rank: int, world_size: int, policy: str = "redistribute"
) -> dict:
    """Return the shard `rank` of a group of `world_size` should load from a full checkpoint."""
    if policy not in RESIZE_POLICIES:
        raise ValueError(f"shard_for_rank: policy={policy!r} must be one of {RESIZE_POLICIES}")
    if not is_full_checkpoint(checkpoint):
        raise ValueError(
            "shard_for_rank: expected a full checkpoint {'world_size', 'shards'} (see "
            "gather_shards)"
        )
    old = int(checkpoint["world_size"])
    shards = checkpoint["shards"]
    if old == world_size:
        return shards[rank]
    if policy == "error":
        raise ValueError(
            f"shard_for_rank: the checkpoint was saved by {old} ranks and is being loaded by "
            f"{world_size}; "
            "pass policy='redistribute' (keep the summed residual) or 'reset' (drop it)"
        )
    base = shards[rank] if rank < old else shards[0]
    new = dict(base)
    new["world_size"] = world_size
    if policy == "reset":
        warnings.warn(
            f"compression checkpoint from {old} ranks loaded by {world_size}: residuals reset to "
            "zero (policy 'reset')",
            RuntimeWarning,
            stacklevel=2,
        )
        new["memory"] = {}
        return new
    warnings.warn(
        f"compression checkpoint from {old} ranks loaded by {world_size}: every rank gets the sum "
        f"of the old ranks' residuals divided by {world_size} (policy 'redistribute')",
        RuntimeWarning,
        stacklevel=2,
    )
    memory: dict[str, dict[str, torch.Tensor]] = {}
    for shard in shards:
        for slot, per_name in shard["memory"].items():
            acc = memory.setdefault(slot, {})
            for name, t in per_name.items():
                acc[name] = acc[name] + t.double() if name in acc else t.double().clone()
    new["memory"] = {
        slot: {n: (t / world_size).float() for n, t in per_name.items()}
        for slot, per_name in memory.items()
    }
    return new


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
