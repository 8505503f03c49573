"""The dense FP32 average: the reference every other compressor is tested against."""
from __future__ import annotations

import torch

from ..engine.stages import StageGen
from .base import Compressor
from .layout import Layout
from .registry import register_compressor

__all__ = ["NoCompression"]


@register_compressor("none")
class NoCompression(Compressor):
    """Average the FP32 buffer densely: divide by the world size, then SUM-allreduce (as DDP's
    allreduce_hook)."""

    dense_average = True

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0) -> StageGen:
        """Return a StageGen yielding `flat / world_size` once; its result is the average."""
        layout.check(flat, "NoCompression.reduce")
        self.stats.add_bucket(numel=flat.numel(), density=1.0)
        flat.div_(self.world_size)
        return (yield from self._stage(flat))
