"""Compression under FSDP2 (`fully_shard`) and HSDP, from the same registration as DDP's.

    state = gradientflow.hooks.register(fsdp_model, CompressionConfig(density=0.01), optimizer=opt)

What travels compressed (fsdp_comms.py has the details):

=============  =================================  =========================================
method         1-D mesh (FSDP2)                   2-D mesh (HSDP: replicate x shard)
=============  =================================  =========================================
"none"         FSDP's own reduce-scatter          reduce-scatter as FSDP; replicate all-reduce
                                                  dense FP32 through the hook
"fp16"         reduce-scatter on the scaled       the same reduce-scatter; replicate
               FP16/BF16 wire                     all-reduce on the scaled FP16/BF16 wire
"csc"          CSC all-reduce of the group's      reduce-scatter dense (inside a host); CSC
               flat gradient, the shard taken     on the replicate all-reduce (across hosts)
=============  =================================  =========================================

Under HSDP FSDP's own replicate all-reduce is turned off for the registered groups (their mesh
info becomes the shard dimension's only; parameters and their DTensor placements are left as
they are), and the hook reduces over the replicate dimension instead, so nothing travels twice.

Gradient accumulation: `set_requires_gradient_sync(False)` works (nothing is reduced until the
step that syncs, which reduces the accumulated gradient once).
"""
from __future__ import annotations

import dataclasses
import io
import warnings

import torch
import torch.distributed as dist

from ..compression import CompressionConfig
from ..compression.adaptive import check_adaptive
from ..compression.momentum import follow_optimizer
from ._state import _share_cores
from .fsdp_checks import check_config, find_groups, is_fsdp_model
from .fsdp_comms import CompressedReduceScatter, ReplicateHook, Unit
from .fsdp_reshard import reshard_units

__all__ = ["FSDPCompressionState", "register_fsdp", "is_fsdp_model"]

_FORMAT = "gradientflow-fsdp-compression/1"


class FSDPCompressionState:
    """What `gradientflow.hooks.register` returns for a `fully_shard` model: the compressors of
    every FSDP parameter group, their checkpoints and statistics.

    Use `register`; the constructor is its implementation.
    """

    def __init__(self, model: torch.nn.Module, config: CompressionConfig, optimizer=None) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        groups = find_groups(model)
        mesh_info = groups[0].fsdp_group.mesh_info
        self.hsdp = isinstance(mesh_info, HSDPMeshInfo)
        self.shard_world = int(mesh_info.shard_mesh_size)
        self.shard_rank = int(mesh_info.shard_mesh_rank)
        self.replicate_world = int(mesh_info.replicate_mesh_size) if self.hsdp else 1
        self.replicate_rank = int(mesh_info.replicate_mesh_rank) if self.hsdp else 0
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._step_open = False
        self._follower = None
        if optimizer is not None:
            config, self._follower = follow_optimizer(
                config, optimizer, f"FSDPCompressionState (rank {self.rank})",
                self._no_velocity, follow_lr=self._follow_lr)
            # After the momentum checks: their refusal names the more specific fix.
            check_adaptive(config, optimizer, f"FSDPCompressionState (rank {self.rank})")
            # A step's reductions end before the optimizer steps: the next reduction opens a step.
            optimizer.register_step_post_hook(lambda *_: self._close_step())
        self.config = config
        # The compression kernels' share of the host's cores, as the DDP hooks take it.
        _share_cores(dist.group.WORLD, self.world_size)
        self.units = [Unit(g.name, g.pieces, self.shard_world, self.shard_rank,
                           self.replicate_world, config) for g in groups]
        self._shapes = {n: shape for g in groups for n, shape in g.shapes.items()}
        self._rows = all(g.rows for g in groups)
        self._install(groups)

    # --- registration -------------------------------------------------------------------------
    def _install(self, groups) -> None:
        for g, unit in zip(groups, self.units):
            pg = g.fsdp_group
            # Every parameter in every reduce-scatter, a zero gradient for an unused one: the
            # layout (and so the residual's) stays the same at every step and on every rank.
            if hasattr(pg, "reduce_scatter_unused_params"):
                pg.reduce_scatter_unused_params = True
            if unit.rs is not None:
                g.module.set_custom_reduce_scatter(CompressedReduceScatter(unit, self._begin_step))
            if unit.ar is not None:
                replicate_group = pg.mesh_info.replicate_process_group
                _shard_only(pg)
                g.module.set_all_reduce_hook(
                    ReplicateHook(unit, replicate_group, pg, self._begin_step))

    def _begin_step(self) -> None:
        if not self._step_open:
            self._step_open = True
            if self._follower is not None:
                self._follower.begin_step()

    def _close_step(self) -> None:
        self._step_open = False

    def _follow_lr(self, lrs: dict[int, float]) -> None:
        """Each residual kept in its parameter's learning-rate units (Compressor.follow_lr)."""
        by_name = {self._names[i]: lr for i, lr in lrs.items() if i in self._names}
        for unit in self.units:
            per: dict = {}
            for pname, targets in unit.residual_names.items():
                if pname in by_name:
                    for comp, rname in targets:
                        per.setdefault(id(comp), (comp, {}))[1][rname] = by_name[pname]
            for comp, rates in per.values():
                comp.follow_lr(rates)

    def _no_velocity(self, buffers: dict) -> None:  # pragma: no cover - momentum correction refused
        raise ValueError("FSDPCompressionState keeps no velocity (momentum correction is off)")

    # --- schedule -----------------------------------------------------------------------------
    def _compressors(self):
        for unit in self.units:
            yield from unit.compressors().values()

    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch-counted warm-up the epoch (call at the start of every epoch)."""
        for c in self._compressors():
            if hasattr(c, "set_epoch"):
                c.set_epoch(epoch)

    def set_step(self, step: int) -> None:
        """Set the step counter of a step-counted warm-up."""
        for c in self._compressors():
            if hasattr(c, "set_step"):
                c.set_step(step)
            else:
                c.step = int(step)

    # --- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Wire bytes on this rank by where they travel: "replicate" (HSDP's all-reduce across the
        replicate dimension) and "shard" (the compressed reduce-scatter), summed over the
        parameter groups.

        Each holds the steps counted, and per step (steady state: after the warm-up, or the
        whole-run average while no steady step has run yet) the wire bytes, the dense FP32
        equivalent and their ratio, as gradientflow.compression.stats defines them.
        """
        out: dict = {}
        for where in ("shard", "replicate"):
            comps = [u.rs if where == "shard" else u.ar for u in self.units]
            comps = [c for c in comps if c is not None]
            if not comps:
                continue
            dicts = [c.stats.as_dict() for c in comps]
            steady = all(d["steady_steps"] for d in dicts)
            per = [d["steady" if steady else "average"] for d in dicts]
            wire = sum(p["wire_bytes"] or 0 for p in per)
            dense = sum(p["dense_fp32_bytes"] or 0 for p in per)
            out[where] = {"steps": dicts[0]["steps"], "steady": steady,
                          "wire_bytes_per_step": wire, "dense_fp32_bytes_per_step": dense,
                          "ratio": dense / wire if wire else None,
                          "wire_bytes": sum(d["wire_bytes"] for d in dicts)}
        return out

    def state_bytes(self) -> int:
        """The bytes of compression state (residuals) this rank keeps, over every group."""
        return sum(c.memory.nbytes() for c in self._compressors())

    # --- checkpoints --------------------------------------------------------------------------
    def _local_state(self) -> dict:
        return {"coord": (self.replicate_rank, self.shard_rank),
                "units": {u.name: {k: c.state_dict() for k, c in u.compressors().items()}
                          for u in self.units}}

    def state_dict(self) -> dict:
        """A checkpoint for torch.distributed.checkpoint, beside the model and optimizer.

        A collective (call it on every rank, as dcp.save and dcp.load do): every rank's
        residuals are gathered into one entry, the same on every rank, so DCP writes it once
        and any world size can read it back (see load_state_dict). Its size is every rank's
        residual together.
        """
        mine = _cpu(self._local_state())
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        buf = io.BytesIO()
        torch.save({"format": _FORMAT, "mesh": self._mesh(), "config":
                    dataclasses.asdict(self.config), "ranks": everyone}, buf)
        return {"gradientflow_fsdp": buf.getvalue()}

    def _mesh(self) -> tuple[int, int]:
        return (self.replicate_world, self.shard_world)

    def load_state_dict(self, state: dict) -> None:
        """Load a checkpoint made by `state_dict` (after dcp.load filled it in).

        Saved on the same mesh: every rank gets its own residuals back exactly. On another
        mesh they are resharded with their sum kept (fsdp_reshard.py), or, where that cannot
        be done, dropped, with a warning saying what that costs; the warm-up position is kept.
        """
        blob = state.get("gradientflow_fsdp") if isinstance(state, dict) else None
        if not isinstance(blob, (bytes, bytearray)) or not blob:
            raise ValueError(
                f"FSDPCompressionState.load_state_dict (rank {self.rank}): the entry holds no "
                "checkpoint of this state; pass what dcp.load filled into state.state_dict()")
        saved = torch.load(io.BytesIO(bytes(blob)), weights_only=False)
        if saved.get("format") != _FORMAT:
            raise ValueError(f"FSDPCompressionState.load_state_dict (rank {self.rank}): format "
                             f"{saved.get('format')!r} is not {_FORMAT!r}")
        if tuple(saved["mesh"]) == self._mesh() and len(saved["ranks"]) == self.world_size:
            self._load_units(saved["ranks"][self.rank]["units"])
            return
        moved = _mesh_text(saved["mesh"]), _mesh_text(self._mesh())
        if self._rows and saved["config"].get("method") == self.config.method:
            residuals = reshard_units(saved, self.units, self.shard_rank, self._shapes)
            self._load_units(saved["ranks"][0]["units"], residuals)
            warnings.warn(
                f"FSDPCompressionState (rank {self.rank}): the checkpoint was saved on a "
                f"{moved[0]} mesh and is loaded on {moved[1]}: the error-feedback residuals "
                "were resharded, their sum kept (every rank now holds its part of the old "
                "ranks' average), so no gradient is lost; which chunks are sent next may "
                "differ from a run that stayed on the old mesh.", RuntimeWarning, stacklevel=2)
            return
        self._load_units(saved["ranks"][0]["units"], {})
        warnings.warn(
            f"FSDPCompressionState (rank {self.rank}): the checkpoint was saved on a "
            f"{moved[0]} mesh and is loaded on {moved[1]}: the error-feedback residuals were "
            "dropped (the parameters are not all sharded by rows, or the method changed). "
            f"{_drop_cost(saved['config'])} Training continues from the loaded weights.",
            RuntimeWarning, stacklevel=2)

    def _load_units(self, units: dict, residuals: dict | None = None) -> None:
        """Load each unit's compressors from `units` (one rank's saved states); `residuals`
        ({unit: {key: {"memory", "residual_lr"}}}, reshard_units') replaces their residuals when
        given ({}: none for any)."""
        for unit in self.units:
            saved = units.get(unit.name)
            if saved is None:
                raise ValueError(
                    f"FSDPCompressionState.load_state_dict (rank {self.rank}): the checkpoint has "
                    f"no state for FSDP module {unit.name or 'the root module'!r}; it holds "
                    f"{sorted(units)}: was the model sharded differently?")
            for key, comp in unit.compressors().items():
                if not saved:  # saved where this unit compressed nothing (method "none")
                    continue
                s = dict(saved.get(key) or next(iter(saved.values())))
                if residuals is not None:
                    moved = residuals.get(unit.name, {}).get(key, {})
                    s["memory"] = moved.get("memory", {})
                    s["residual_lr"] = moved.get("residual_lr", {})
                s["world_size"] = comp.world_size
                comp.load_state_dict(s)


def _drop_cost(config: dict) -> str:
    """What dropping the residuals of a checkpoint saved under `config` (asdict) costs."""
    if config.get("method") != "csc":
        return ("They held the wire's rounding error only (a fraction of an FP16 ulp of one "
                "step's gradient per element): next to nothing is lost.")
    d = float(config.get("density", 1.0))
    waits = max(1, round(1.0 / d))
    return (f"At density {d:g} a chunk waits about {waits} steps before it is sent, so up to "
            f"about {waits} steps of unsent gradient are lost once.")


def _mesh_text(mesh) -> str:
    r, s = mesh
    return f"{s}-rank" if r == 1 else f"{r} x {s} (replicate x shard)"


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _shard_only(pg) -> None:
    """Turn FSDP's own HSDP all-reduce off for one parameter group: its mesh info becomes the
    shard dimension's only (the same fields, FSDPMeshInfo's class), so foreach_reduce calls the
    all-reduce hook right after the reduce-scatter instead of after its own all-reduce."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    old = pg.mesh_info
    new = FSDPMeshInfo.__new__(FSDPMeshInfo)
    new.__dict__.update(old.__dict__)
    pg.mesh_info = new
    if pg.post_forward_mesh_info is old:
        pg.post_forward_mesh_info = new


def register_fsdp(model: torch.nn.Module, config: CompressionConfig, process_group=None, *,
                  optimizer=None, grad_scaler=None) -> FSDPCompressionState:
    """Register compression on a `fully_shard` model (1-D mesh) or an HSDP one (2-D mesh);
    return its state. What `gradientflow.hooks.register` calls for such a model."""
    check_config(config, process_group, grad_scaler)
    return FSDPCompressionState(model, config, optimizer=optimizer)
