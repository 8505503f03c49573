"""CSC's options: which chunks are sent, the dense warm-up, momentum correction, what is dense,
whether an Adam-family optimizer is accepted.

Registered with the method (csc.py); read as attributes of the CompressionConfig
(`config.density`). Defaults are chosen for ResNet-50-sized models (25.6 M parameters, 161
tensors, 54,120 of them in one-dimensional BN/bias tensors); the reason for each sits beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import wire_dtype_name
from .registry import Options

__all__ = ["CSCOptions", "DGC_WARMUP", "DENSE_FIRST_WARMUP", "DEFAULT_MOMENTUM"]

# Deep Gradient Compression's warm-up (Lin et al. 2018, section 3.3): 75%, 93.75%, 98.4375%,
# 99.6% sparsity over the first four epochs, then the target.
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
# The default: one dense stage first (the first steps move the weights most, and a residual
# built from a random start would carry stale directions for many steps), then DGC's stages.
DENSE_FIRST_WARMUP = (1.0,) + DGC_WARMUP
# The momentum the compressor applies when neither the config nor a bound optimizer gives one:
# SGD's usual 0.9, the value DGC used for ResNet-50.
DEFAULT_MOMENTUM = 0.9


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CSCOptions(Options):
    """CSC's own options (validated at construction; see each field's reason)."""

    # --- selection ---------------------------------------------------------------------------
    # 1% of the chunks: with an FP16 payload, two orders of magnitude fewer wire bytes
    # (benchmarks/results/compression), while DGC trains ResNet-50 to full accuracy at 0.1%: 1%
    # leaves a 10x margin because our selection is per chunk, coarser than DGC's per element.
    density: float = 0.01
    # 1024 elements = 4 KiB of FP32: the norm vector costs 4 bytes per chunk, i.e. 1/1024 of the
    # dense bytes (about a fifth of a 1%-FP16 payload); halving C doubles that overhead, doubling
    # it makes the selection coarser. Long contiguous chunks also keep pack/unpack at copy speed.
    chunk_size: int = 1024
    # L1 by default: one add per element (no multiply) and, unlike squared L2, it cannot
    # overflow FP32 for any finite gradient a loss scaler lets through. "l2" selects the same
    # chunks as the (squared) Euclidean norm would.
    norm: str = "l1"
    # Which chunks compete. "bucket" (the default) gives each bucket its own quota of
    # ceil(density x chunks), fused or not; "pool" ranks the chunks of every bucket of one fused
    # batch together (the engine fuses the buckets queued together, up to the fusion threshold
    # in dense bytes), so what travels no longer depends on DDP's bucket_cap_mb. "bucket" is
    # the default because "pool" lost accuracy against it in the digits experiment (the
    # numbers: docs/DESIGN.md's defaults table): a whole-model ranking starves the layers whose
    # gradients are small, as DGC's per-layer top-k does not.
    selection: str = "bucket"
    # Dtype for the tensors sent dense inside a CSC bucket (BN/bias); None = wire_dtype. FP16
    # here halves the dense tail's bytes, a visible share of a 1% message; the rounding error
    # stays in the residual.
    dense_wire_dtype: str | None = None

    # --- dense warm-up ------------------------------------------------------------------------
    # Density per warm-up stage before the target; a stage below the target is raised to it
    # (warm-up only ever ramps down towards the target). () disables warm-up.
    warmup_densities: tuple[float, ...] = DENSE_FIRST_WARMUP
    # "step" by default: the compressor counts its own steps (one per completed backward pass),
    # so the schedule advances with nothing for the user to call. "epoch" is DGC's unit: then
    # call set_epoch(epoch) at the start of every epoch, like DistributedSampler.set_epoch.
    warmup_unit: str = "step"
    # Units (steps or epochs) per warm-up stage. 5 steps: the dense stage and DGC's three
    # stages above 1% end after 20 steps, about one epoch of the digits experiment (22 steps an
    # epoch), as DGC's first epochs are of ImageNet; a long run wants warmup_unit="epoch".
    warmup_period: int = 5

    # --- momentum correction ----------------------------------------------------------------
    # DGC momentum correction + factor masking: the compressor accumulates velocity, not
    # gradient, and the optimizer then runs without momentum. Off by default: on Fashion-MNIST
    # (3 epochs, 2 ranks, small matrices sent dense) the ResNet-shaped model with plain SGD ends
    # 1.7 points higher without it (mean of 3 seeds), level with DDP (docs/DECISIONS.md has the
    # other pairs); the optimizer keeps its own momentum, applied to the averaged sparse gradient,
    # and the residual still follows its learning rates (momentum.LRFollower).
    # When on, the hook registration and the DistributedOptimizer bind the SGD: the compressor
    # applies its momentum, Nesterov and weight decay, read from its groups at every step, and
    # its own step runs with them at 0, so nothing is applied twice (compression/momentum.py).
    # A step at density 1 masks nothing (every chunk is sent, none is stale): the warm-up's
    # dense stage is SGD with momentum on the average.
    momentum_correction: bool = False
    # None: the bound optimizer's momentum, followed at every step (DEFAULT_MOMENTUM without
    # one). With an optimizer bound, a value here must be its momentum at registration.
    momentum: float | None = None
    nesterov: bool = False
    # DGC's local gradient clipping: before accumulating, each rank scales every parameter's
    # gradient to an L2 norm of at most clip_norm / sqrt(world_size), so the sum over ranks
    # stays within clip_norm. None: no clipping (gradients may also be clipped by the user).
    clip_norm: float | None = None

    # --- what is sent dense --------------------------------------------------------------------
    # DGC sparsifies only tensors with dim > 1: biases and BN parameters are tiny (54,120 of
    # ResNet-50's 25.6 M values) but sensitive.
    dense_1d: bool = True
    # Matrices of fewer than 16 default chunks travel dense rather than compete for a bucket's
    # quota with the large layers beside them (at 1%, shared evenly, a chunk travels about once
    # in 100 steps): sent at every step, they closed most of the Fashion-MNIST models' gap to
    # dense (docs/DECISIONS.md). They are few where models are large: ResNet-50 gains two
    # (+4% bytes), AlexNet none.
    min_numel: int = 16384

    # --- the optimizer ---------------------------------------------------------------------------
    # False: an Adam-family optimizer bound at registration is refused (compression/adaptive.py
    # says why and what works). Adam's per-coordinate normalisation turns a chunk's summed
    # residual into about one step's movement; on the byte-level GPT with AdamW no CSC option
    # tried at 1% came near dense (experiments/lm/README.md). True runs it anyway.
    allow_adaptive_optimizer: bool = False

    def __post_init__(self) -> None:
        d = self.density
        if not isinstance(d, (int, float)) or math.isnan(d) or not 0.0 < float(d) <= 1.0:
            raise ValueError(f"CompressionConfig: density={d!r} must be in (0, 1] (the fraction "
                             "of chunks sent)")
        if not _is_int(self.chunk_size) or self.chunk_size < 1:
            raise ValueError(f"CompressionConfig: chunk_size={self.chunk_size!r} must be an "
                             "integer >= 1 (elements per chunk)")
        if self.norm not in ("l1", "l2"):
            raise ValueError(f"CompressionConfig: norm={self.norm!r} must be 'l1' or 'l2'")
        if self.selection not in ("pool", "bucket"):
            raise ValueError(f"CompressionConfig: selection={self.selection!r} must be 'pool' "
                             "(top chunks across a fused batch of buckets) or 'bucket' (a quota "
                             "per bucket)")
        if self.dense_wire_dtype is not None:
            object.__setattr__(self, "dense_wire_dtype",
                               wire_dtype_name(self.dense_wire_dtype, "dense_wire_dtype"))
        stages = tuple(self.warmup_densities)
        for s in stages:
            if not isinstance(s, (int, float)) or not 0.0 < float(s) <= 1.0:
                raise ValueError(f"CompressionConfig: warmup_densities={stages!r}: every stage "
                                 "must be in (0, 1]")
        object.__setattr__(self, "warmup_densities", stages)
        if self.warmup_unit not in ("epoch", "step"):
            raise ValueError(f"CompressionConfig: warmup_unit={self.warmup_unit!r} must be "
                             "'epoch' or 'step'")
        if not _is_int(self.warmup_period) or self.warmup_period < 1:
            raise ValueError(f"CompressionConfig: warmup_period={self.warmup_period!r} must be "
                             "an integer >= 1")
        if self.momentum is not None and not 0.0 <= float(self.momentum) < 1.0:
            raise ValueError(f"CompressionConfig: momentum={self.momentum!r} must be in [0, 1) "
                             "(or None: the optimizer's)")
        c = self.clip_norm
        if c is not None and not (isinstance(c, (int, float)) and 0.0 < float(c) < math.inf):
            raise ValueError(f"CompressionConfig: clip_norm={c!r} must be a finite number > 0 "
                             "(or None: no local clipping)")
        if not isinstance(self.allow_adaptive_optimizer, bool):
            raise ValueError(f"CompressionConfig: allow_adaptive_optimizer="
                             f"{self.allow_adaptive_optimizer!r} must be True or False")
        if not _is_int(self.min_numel) or self.min_numel < 0:
            raise ValueError(f"CompressionConfig: min_numel={self.min_numel!r} must be an "
                             "integer >= 0")

    def check(self, config) -> None:
        """Refuse momentum correction without error feedback (its velocity lives in the
        residual)."""
        if self.momentum_correction and not config.error_feedback:
            raise ValueError(
                "CompressionConfig: momentum_correction=True needs error_feedback=True (the "
                "residual is where the corrected velocity accumulates); pass "
                "momentum_correction=False as well")

    # --- derived values --------------------------------------------------------------------------
    @property
    def momentum_value(self) -> float:
        """The momentum factor the compressor applies under momentum correction."""
        return DEFAULT_MOMENTUM if self.momentum is None else float(self.momentum)

    @property
    def warmup_length(self) -> int:
        """Units (epochs or steps) until the target density is in force."""
        return len(self.warmup_densities) * self.warmup_period

    def density_at(self, epoch: int, step: int) -> float:
        """Return the density in force at this epoch/step (warm-up stage, never below target)."""
        unit = epoch if self.warmup_unit == "epoch" else step
        stage = unit // self.warmup_period
        if 0 <= stage < len(self.warmup_densities):
            return max(float(self.warmup_densities[stage]), float(self.density))
        return float(self.density)

    def in_warmup(self, epoch: int, step: int) -> bool:
        """Whether a warm-up stage (not the steady-state target) is in force."""
        unit = epoch if self.warmup_unit == "epoch" else step
        return unit < self.warmup_length and self.density_at(epoch, step) != float(self.density)

    def is_dense_param(self, shape: tuple[int, ...]) -> bool:
        """Whether a parameter of this shape is sent dense inside a CSC bucket."""
        numel = math.prod(shape)
        return (self.dense_1d and len(shape) <= 1) or numel < self.min_numel
