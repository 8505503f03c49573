"""FP16/BF16 wire: pre-scale by 1/world_size, cast, SUM-allreduce, cast back.

Pre-scaling BEFORE the sum is what keeps the sum in range: if every rank's values fit the wire
type, so does their average, whereas the plain sum of n of them can overflow (Horovod #278,
#1699). With error feedback the rounding error of the cast stays in the residual, so nothing is
lost over steps beyond the rounding of the sum itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradientflow import kernels

from ..engine.stages import StageGen
from .base import Compressor
from .layout import Layout
from .registry import Options, register_compressor
from .wire_scale import agree as agree_scale

__all__ = ["HalfCompressor", "HalfOptions"]


@dataclass(frozen=True)
class HalfOptions(Options):
    """FP16's options: none of its own beyond the common ones; it refuses an FP32 wire."""

    def check(self, config) -> None:
        """Refuse an FP32 wire: this method exists to halve the bytes."""
        if config.wire_dtype == "fp32":
            raise ValueError(
                "CompressionConfig: method 'fp16' casts to a half-precision wire, but "
                "wire_dtype='fp32'; "
                "use wire_dtype 'fp16' or 'bf16' (or method 'none' for the dense FP32 average)"
            )


@register_compressor("fp16", options=HalfOptions)
class HalfCompressor(Compressor):
    """Send the whole buffer in the half-precision wire dtype (config.wire_dtype: fp16 or bf16)."""

    def __init__(self, config, world_size: int) -> None:
        super().__init__(config, world_size)
        # One wire buffer per (layout, device), reused every step: a fresh 51 MB tensor per
        # ResNet-50 step would be fresh pages each time (page faults on first touch).
        self._wire: dict[tuple, torch.Tensor] = {}
        kernels.start_threads()  # on the building (main) thread

    def _wire_buffer(self, layout: Layout, flat: torch.Tensor) -> torch.Tensor:
        key = (layout, flat.device, self.config.torch_wire_dtype)
        buf = self._wire.get(key)
        if buf is None:
            buf = self._wire[key] = torch.empty(flat.numel(), dtype=key[2], device=flat.device)
        return buf

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0,
               final: bool = False) -> StageGen:
        """Return a StageGen: v = grad + residual; send cast(v / n); residual <- rounding error.

        Two passes over the buffer in all: one fused kernel before the allreduce (add, cast,
        rounding error into the spare residual) and one after (upcast into ``flat`` and the
        finiteness test), where the eager chain took six (benchmarks/bench_kernels.py).
        """
        layout.check(flat, "HalfCompressor.reduce")
        cfg, n = self.config, self.world_size
        self.stats.add_bucket(numel=flat.numel(), density=1.0)
        wire = self._wire_buffer(layout, flat)
        mem = (self.memory.get(layout, ("residual", "_residual_spare"), flat, loss_scale)
               if cfg.error_feedback else {})
        # FP16: the power of two all ranks scale this message by, so that small gradients do not
        # flush to zero (wire_scale.py; ws.pre = 2^e / n, ws.post = 2^-e, ws.err = n / 2^e).
        ws = yield from agree_scale(n, cfg.torch_wire_dtype, self._stage, flat, mem.get("residual"))
        if cfg.error_feedback:
            # The candidate residual v - upcast(wire) * n / 2^e goes to the spare buffer; it is
            # committed (by a swap) only if the reduced result is finite: a step GradScaler skips
            # must leave the residual alone.
            kernels.cast_feedback(flat, mem["residual"], ws.pre, cfg.torch_wire_dtype, ws.err,
                                  out=wire, residual_out=mem["_residual_spare"])
        else:
            kernels.cast_scaled(flat, ws.pre, cfg.torch_wire_dtype, out=wire)
        reduced = yield from self._stage(wire, final)
        # Decided from the reduced result, so the same on every rank; a non-finite step's
        # commit is undone by end_step.
        if flat.is_cuda:
            # A flag left on the device (end_step reads the step's flags once): no host wait.
            kernels.upcast_scaled(reduced, ws.post, out=flat)
            self._note_finite(torch.isfinite(flat).all())
        else:
            self._note_finite(kernels.upcast_finite(reduced, ws.post, out=flat))
        if cfg.error_feedback:
            self.memory.commit(layout, (("residual", "_residual_spare"),))
        return flat
