"""Which FSDP2 parameter groups a model has, and what registration refuses, before the first step.

Every refusal is a ValueError whose sentence names the rank, what was found and what works.
FSDP2's per-group state is reached through `FSDPModule._get_fsdp_state()` (private to torch):
a torch that lacks it, or lacks a hook, is refused the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compression import CompressionConfig

__all__ = ["Group", "HOOKS", "SUPPORTED_METHODS", "find_groups", "check_config", "is_fsdp_model"]

# The methods that run under FSDP2 (the others are registered for DDP's buckets only).
SUPPORTED_METHODS = ("none", "fp16", "csc")
# What registration calls or reads on FSDPModule; a torch lacking any of them is refused.
HOOKS = ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_requires_all_reduce",
          "set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "_get_fsdp_state")


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def is_fsdp_model(model) -> bool:
    """Whether `model` (or a module inside it) was sharded with `fully_shard`."""
    cls = _fsdp_module_class()
    return (cls is not None and isinstance(model, torch.nn.Module)
            and any(isinstance(m, cls) for m in model.modules()))


@dataclass
class Group:
    """One FSDP parameter group: its module, its name in checkpoints, its torch state,
    (parameter name, padded shard shape) of its parameters in FSDP's order, their full shapes,
    and whether every one is sharded on dim 0 (its pieces are rows)."""

    module: torch.nn.Module
    name: str
    fsdp_group: object
    pieces: list
    shapes: dict
    rows: bool


def _where() -> str:
    return f"gradientflow.hooks.register (rank {dist.get_rank() if dist.is_initialized() else 0})"


def check_config(config: CompressionConfig, process_group, grad_scaler) -> None:
    """Refuse what the FSDP2 path does not run, naming what does."""
    where = _where()
    if config.method not in SUPPORTED_METHODS:
        raise ValueError(
            f"{where}: method {config.method!r} is not available under FSDP2; use one of "
            f"{SUPPORTED_METHODS} (or wrap the model in DistributedDataParallel)")
    if getattr(config, "momentum_correction", False):  # a CSC option only
        raise ValueError(
            f"{where}: momentum_correction=True is not available under FSDP2 (the optimizer "
            "steps the shards); use the default, error feedback beside the optimizer's own "
            "momentum (momentum_correction=False)")
    if process_group is not None:
        raise ValueError(
            f"{where}: process_group is given, but a fully_shard model reduces over its own "
            "device mesh; leave process_group=None")
    if grad_scaler is not None:
        raise ValueError(
            f"{where}: grad_scaler is given, but the FSDP2 path runs FP32 gradients without a "
            "loss scale; leave grad_scaler=None (and the model in float32)")


def find_groups(model: torch.nn.Module) -> list[Group]:
    """The model's FSDP parameter groups, each checked; ValueError names what to change."""
    where = _where()
    cls = _fsdp_module_class()
    missing = [h for h in HOOKS if cls is None or not hasattr(cls, h)]
    if missing:
        raise ValueError(
            f"{where}: torch {torch.__version__} lacks FSDPModule.{', .'.join(missing)}, which "
            "compression under FSDP2 hooks into; use torch 2.14 or later (where each exists), "
            "or DistributedDataParallel")
    names = {id(p): n for n, p in model.named_parameters()}
    groups: list[Group] = []
    meshes = set()
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, cls):
            continue
        state = mod._get_fsdp_state()
        pgs = list(getattr(state, "_fsdp_param_groups", []))
        label = mod_name or "the root module"
        if len(pgs) > 1:
            raise ValueError(
                f"{where}: {label} has {len(pgs)} parameter groups (per-parameter meshes from "
                "shard_placement_fn), and FSDP refuses hooks on such a module; shard every "
                "module's parameters on one mesh (the default Shard(0) placement works)")
        for pg in pgs:
            _check_group(pg, label, where)
            meshes.add(id(pg.mesh_info.mesh))
            pieces, shapes, rows = [], {}, True
            for fp in pg.fsdp_params:
                name = names.get(id(fp.sharded_param))
                if name is None:
                    raise ValueError(
                        f"{where}: a parameter of {label} is not among model.named_parameters(); "
                        "register the model that was sharded (the root fully_shard module)")
                pieces.append((name, tuple(int(s) for s in fp.padded_sharded_param_size)))
                shapes[name] = tuple(int(s) for s in fp.sharded_param.shape)
                rows = rows and getattr(getattr(fp, "fsdp_placement", None), "dim", 0) == 0
            groups.append(Group(mod, mod_name, pg, pieces, shapes, rows))
    if not groups:
        raise ValueError(f"{where}: the model has no fully_shard parameters to compress")
    if len(meshes) > 1:
        raise ValueError(
            f"{where}: the model's fully_shard modules use {len(meshes)} device meshes; "
            "compression runs on one: shard every module on the same mesh")
    return groups


def _check_group(pg, label: str, where: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    if not isinstance(pg.mesh_info, FSDPMeshInfo):
        raise ValueError(
            f"{where}: {label} is replicated only (a 1-D replicate mesh), not sharded; use "
            "fully_shard on a 1-D mesh or HSDP on a 2-D (replicate, shard) mesh, or "
            "DistributedDataParallel")
    if isinstance(pg.offload_policy, CPUOffloadPolicy):
        raise ValueError(
            f"{where}: {label} offloads to the CPU (CPUOffloadPolicy), but the residuals "
            "would live beside the shards on the device the offload empties; shard without "
            "offload (offload_policy=OffloadPolicy(), the default), or leave it uncompressed")
    mp = pg.mp_policy
    reduce_dtype = mp.reduce_dtype or mp.param_dtype
    if reduce_dtype is not None and reduce_dtype != torch.float32:
        raise ValueError(
            f"{where}: {label}'s MixedPrecisionPolicy reduces in {reduce_dtype}, but the "
            "compressed wire takes float32 gradients and picks its own dtype "
            "(CompressionConfig.wire_dtype: 'fp16' or 'bf16' halves the bytes); set "
            "MixedPrecisionPolicy(reduce_dtype=torch.float32) (param_dtype may stay)")
    for fp in pg.fsdp_params:
        if fp.sharded_param.requires_grad and fp.sharded_param.dtype != torch.float32:
            raise ValueError(
                f"{where}: a parameter of {label} is {fp.sharded_param.dtype}; compression "
                "needs float32 gradients: keep float32 parameters (a MixedPrecisionPolicy "
                "param_dtype computes in lower precision while they stay float32)")
    if (getattr(pg, "gradient_divide_factor", None) is not None
            or getattr(pg, "force_sum_reduction_for_comms", False)):
        raise ValueError(
            f"{where}: {label} has set_gradient_divide_factor or "
            "set_force_sum_reduction_for_comms set, but a compressed reduction computes the "
            "average; leave both unset")
    if not getattr(pg, "all_reduce_grads", True) and getattr(pg, "reduce_grads", True):
        raise ValueError(
            f"{where}: {label} has set_requires_all_reduce(False), but the replicate "
            "dimension's reduction is compressed at every reduce-scatter; accumulate with "
            "set_requires_gradient_sync(False) instead (it works)")
    comm = getattr(pg, "_reduce_scatter_comm", None)
    if (comm is not None and not isinstance(comm, DefaultReduceScatter)) or getattr(
            pg, "_all_reduce_hook", None):
        raise ValueError(
            f"{where}: {label} already has a custom reduce-scatter or all-reduce hook (was "
            "the model registered twice?); register a model once")
