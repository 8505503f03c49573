"""What runs inside FSDP2's reduction when a compression state is registered on a sharded model.

Two places, one per FSDP parameter group (a `fully_shard` module's parameters, one flat buffer):

- `CompressedReduceScatter`, given to ``set_custom_reduce_scatter``: the reduce-scatter over the
  shard dimension. FSDP hands it the rank's whole (unsharded) gradient laid out as the
  shard-group's pieces back to back (piece r is what rank r owns) and an output of one piece.
  - method "fp16": a true reduce-scatter in the half-precision wire dtype, every rank's values
    pre-scaled by the agreed power of two (compression/wire_scale.py), the cast's rounding
    error kept as a residual.
  - method "csc": a CSC all-reduce of the whole flat buffer (CSCCompressor, unchanged: its
    selection, dense tail, wire scale and error feedback), then the rank's piece is taken.
    Chosen over a sparse reduce-scatter of the selected chunks because it is the compressor
    the DDP hook runs, already tested against its reference, and every rank receives the same
    chunks; the price is that the k selected chunks travel to every rank, where a sparse
    reduce-scatter would send each only to its owner (at most twice the bytes of that, still
    about the density times the dense reduce-scatter's).
- `ReplicateHook`, given to ``set_all_reduce_hook`` under HSDP: the all-reduce over the
  replicate dimension (the slow, cross-host one), run by any compressor (NoCompression,
  HalfCompressor, CSCCompressor) on the rank's reduce-scattered shard.

Residual memory: on the replicate all-reduce the input is the shard, so the residual is one FP32
copy of the rank's shard. On a compressed reduce-scatter what a rank did not send is its own
contribution to EVERY rank's piece, so it keeps one FP32 copy of the group's unsharded gradient
(shard-group size x its shard): no compression of a reduce-scatter can keep less without losing
that gradient mass. Under HSDP the reduce-scatter inside a host therefore stays dense under CSC.
Each is the only copy: the state is updated in place (`Compressor.keep_state_in_place`), not
through the DDP path's spare buffer, because nothing here needs undoing: registration refuses a
loss scaler, and each reduction runs to its end inside FSDP's call (a step whose result is not
finite zeroes the residual's non-finite elements instead).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradientflow import kernels

from ..compression import CompressionConfig, Compressor, Layout, make_compressor
from ..compression import wire_scale
from ..compression.memory import ResidualMemory
from ..compression.stats import CompressionStats
from ..engine.stages import drive

__all__ = ["Unit", "CompressedReduceScatter", "ReplicateHook", "HalfReduceScatter"]

try:  # the interface set_custom_reduce_scatter takes; registration refuses a torch without it
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - refused before use (fsdp.py)
    _ReduceScatterBase = object


def _allreduce(group):
    def run(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)
    return run


def _check_op(op, who: str, rank: int) -> None:
    """FSDP asks for the average (AVG); anything else means a divide factor or forced sums were
    set, which registration refuses, so meeting one here is a bug worth a sentence."""
    if op != dist.ReduceOp.AVG:
        raise RuntimeError(
            f"{who} (rank {rank}): FSDP asked for reduce op {op}, but a compressed reduction "
            "computes the average only: leave set_gradient_divide_factor and "
            "set_force_sum_reduction_for_comms unset on a compressed model")


class HalfReduceScatter:
    """A reduce-scatter of an FP32 flat buffer over an FP16/BF16 wire, with the agreed
    power-of-two scale and error feedback of the cast's rounding (as HalfCompressor, whose
    kernels it calls, does for an all-reduce).

    The residual covers the whole input (see the module docstring for why).
    """

    name = "fp16"

    def __init__(self, config: CompressionConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.memory = ResidualMemory(double_buffer=False)  # in place: the module docstring
        self.stats = CompressionStats()
        self.step = 0
        self._finite = True
        kernels.start_threads()

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, layout: Layout,
                       group) -> None:
        """output <- the average over the group of every rank's piece `rank` of `flat`."""
        cfg, n = self.config, self.world_size
        dtype = cfg.torch_wire_dtype
        self.stats.add_bucket(numel=flat.numel(), density=1.0)
        mem = (self.memory.get(layout, ("residual", "_residual_spare"), flat)
               if cfg.error_feedback else {})
        # The power of two every rank scales by: agreed from the SUM of the ranks' bounds.
        ws = wire_scale.unscaled(n)
        if wire_scale.needs_scale(dtype):
            bound = wire_scale.local_bound(flat, mem.get("residual")).reshape(1).clone()
            self.stats.add_wire(bound.numel() * bound.element_size())
            dist.all_reduce(bound, group=group)
            ws = wire_scale.scale_for(float(bound), n, dtype)
        wire = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
        if cfg.error_feedback:
            kernels.cast_feedback(flat, mem["residual"], ws.pre, dtype, ws.err, out=wire,
                                  residual_out=mem["_residual_spare"])
        else:
            kernels.cast_scaled(flat, ws.pre, dtype, out=wire)
        out_wire = torch.empty(output.numel(), dtype=dtype, device=flat.device)
        self.stats.add_wire(wire.numel() * wire.element_size())
        dist.reduce_scatter_tensor(out_wire, wire, group=group)
        if output.is_cuda:  # as HalfCompressor: the one-pass test is the CPU kernel's
            kernels.upcast_scaled(out_wire, ws.post, out=output)
            finite = bool(torch.isfinite(output).all())
        else:
            finite = kernels.upcast_finite(out_wire, ws.post, out=output)
        if cfg.error_feedback:
            self.memory.commit(layout, (("residual", "_residual_spare"),))
        self._finite = finite

    def end_step(self) -> None:
        """Close a step, count it. A non-finite one (the loss diverged) has its residual's
        non-finite elements zeroed: a residual of infinities would poison every later step even
        after the loss recovers."""
        self.memory.end_step(revert=not self._finite)
        self._finite = True
        self.stats.end_step()
        self.step += 1

    def follow_lr(self, lrs: dict[str, float]) -> None:
        """The rounding residual is a few ulps of one step's gradient: it is not rescaled."""

    def state_dict(self) -> dict:
        return {"method": self.name, "world_size": self.world_size, "epoch": 0,
                "step": self.step, "memory": self.memory.state_dict(),
                "stats": self.stats.state_dict(), "residual_lr": {}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"])
        self.stats.load_state_dict(state["stats"])


class Unit:
    """One FSDP parameter group's compression: its layouts, and the compressor on each of the
    two reductions it runs (None where that reduction is FSDP's own, dense).

    Args:
        name: the group's key in checkpoints (its module's name; "" for the root).
        pieces: (parameter name, padded shard shape) of the group's parameters, in FSDP's order.
        shard_world, shard_rank: the shard dimension's size and this rank's place in it.
        replicate_world: the replicate dimension's size (1 without HSDP).
        config: the CompressionConfig.
    """

    def __init__(self, name: str, pieces: list[tuple[str, tuple[int, ...]]], shard_world: int,
                 shard_rank: int, replicate_world: int, config: CompressionConfig) -> None:
        self.name = name
        self.shard_rank = shard_rank
        self.shard_layout = Layout.from_shapes(pieces)
        # The reduce-scatter's input: every rank's piece of every parameter, rank by rank.
        self.full_layout = Layout.from_shapes(
            (f"{p}#{r}", shape) for r in range(shard_world) for p, shape in pieces)
        method = config.method
        self.rs: HalfReduceScatter | Compressor | None = None
        self.ar: Compressor | None = None
        hsdp = replicate_world > 1
        if method == "fp16" and shard_world > 1:
            self.rs = HalfReduceScatter(config, shard_world)
        elif method == "csc" and shard_world > 1 and not hsdp:
            self.rs = make_compressor(config, shard_world)
        if hsdp:
            self.ar = make_compressor(config, replicate_world)
        for comp in (self.rs, self.ar):
            if isinstance(comp, Compressor):
                comp.keep_state_in_place()  # one copy of the residual (the module docstring)
        # Parameter name -> [(compressor, the name its residual is kept under)].
        self.residual_names: dict[str, list[tuple[object, str]]] = {}
        for p in self.shard_layout.names:
            targets = self.residual_names.setdefault(p, [])
            if self.ar is not None:
                targets.append((self.ar, p))
            if self.rs is not None:
                targets.extend((self.rs, f"{p}#{r}") for r in range(shard_world))

    def compressors(self) -> dict[str, object]:
        """{"rs": ..., "ar": ...}: the compressors this unit runs."""
        return {k: c for k, c in (("rs", self.rs), ("ar", self.ar)) if c is not None}


class CompressedReduceScatter(_ReduceScatterBase):
    """FSDP2's reduce-scatter for one parameter group, compressed by its unit's `rs` compressor
    (``FSDPModule.set_custom_reduce_scatter``); see the module docstring."""

    def __init__(self, unit: Unit, begin_step) -> None:
        self.unit = unit
        self._begin_step = begin_step

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain tensor: nothing here needs a special pool."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 op=dist.ReduceOp.AVG, async_op: bool = False):
        unit = self.unit
        who = f"gradientflow FSDP reduce-scatter of {unit.name or 'the root module'}"
        _check_op(op, who, dist.get_rank())
        layout = unit.full_layout
        if input_tensor.numel() != layout.numel or input_tensor.dtype != torch.float32:
            raise RuntimeError(
                f"{who} (rank {dist.get_rank()}): got {input_tensor.numel()} "
                f"{input_tensor.dtype} elements, expected {layout.numel} float32 ones (every "
                "parameter of the group, reduced in float32); a parameter without a gradient "
                "this step, or a mixed-precision reduce dtype, changes that")
        self._begin_step()
        comp = unit.rs
        if isinstance(comp, HalfReduceScatter):
            comp.reduce_scatter(output_tensor, input_tensor, layout, group)
        else:
            drive(comp.reduce(input_tensor, layout), _allreduce(group))
            piece = input_tensor.view(comp.world_size, -1)[unit.shard_rank]
            output_tensor.copy_(piece)
        comp.end_step()
        return None


class ReplicateHook:
    """HSDP's all-reduce over the replicate dimension for one parameter group, compressed by its
    unit's `ar` compressor (``FSDPModule.set_all_reduce_hook``)."""

    def __init__(self, unit: Unit, group, fsdp_group, begin_step) -> None:
        self.unit = unit
        self.group = group
        self._fsdp_group = fsdp_group
        self._begin_step = begin_step

    def __call__(self, reduce_output: torch.Tensor) -> None:
        unit = self.unit
        if not getattr(self._fsdp_group, "all_reduce_grads", True):
            raise RuntimeError(
                f"gradientflow HSDP all-reduce of {unit.name or 'the root module'} (rank "
                f"{dist.get_rank()}): set_requires_all_reduce(False) is set, but the replicate "
                "dimension's reduction is compressed at every reduce-scatter; accumulate with "
                "set_requires_gradient_sync(False) instead (it works: nothing is reduced until "
                "the step that syncs)")
        self._begin_step()
        drive(unit.ar.reduce(reduce_output, unit.shard_layout), _allreduce(self.group))
        unit.ar.end_step()
