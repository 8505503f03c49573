"""FP16/BF16 wire: pre-scale by 1/world_size, cast, SUM-allreduce, cast back.

Pre-scaling BEFORE the sum is what keeps the sum in range: if every rank's values fit the wire
type, so does their average, whereas the plain sum of n of them can overflow (Horovod #278,
#1699). With error feedback the rounding error of the cast stays in the residual, so nothing is
lost over steps beyond the rounding of the sum itself.
"""
from __future__ import annotations

import math

import torch

from gradientflow import kernels

from ..engine.stages import StageGen
from .base import Compressor
from .layout import Layout
from .registry import register_compressor

__all__ = ["HalfCompressor"]


@register_compressor("fp16")
class HalfCompressor(Compressor):
    """Send the whole buffer in the half-precision wire dtype (config.wire_dtype: fp16 or bf16)."""

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0) -> StageGen:
        """Return a StageGen: v = grad + residual; send cast(v / n); residual <- rounding error."""
        layout.check(flat, "HalfCompressor.reduce")
        cfg, n = self.config, self.world_size
        self.stats.add_bucket(numel=flat.numel(), density=1.0)
        residual = None
        if cfg.error_feedback:
            mem = self.memory.get(layout, ("residual", "_residual_spare"), flat, loss_scale)
            residual = mem["residual"]
            flat.add_(residual)
        wire = kernels.cast_scaled(flat, 1.0 / n, cfg.torch_wire_dtype)
        if residual is not None:
            # The candidate residual v - upcast(wire) * n goes to the spare buffer; it is committed
            # (by a swap) only if the reduced result is finite: a step GradScaler skips must leave
            # the residual alone.
            # (upcast by the kernel, then an FP32 subtract: torch's mixed-dtype sub was ~5x slower).
            spare = kernels.upcast_scaled(wire, float(n), out=mem["_residual_spare"])
            torch.sub(flat, spare, out=spare)
        reduced = yield from self._stage(wire)
        out = kernels.upcast_scaled(reduced, 1.0, out=flat)
        # Decided from the reduced result, so the same on every rank. A float32 sum is one vectorised
        # pass (isfinite(x).all() was ~30x slower here on CPU) and is non-finite iff an element is,
        # except if the sum itself overflows (|sum| > 3.4e38, gradients near FP32's limit), which
        # only skips this step's residual update, the safe side.
        if not math.isfinite(float(out.sum())):
            self._step_non_finite = True
        elif residual is not None:
            self.memory.commit(layout, (("residual", "_residual_spare"),))
        return out
