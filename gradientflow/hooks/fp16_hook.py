"""DDP communication hook for an FP16/BF16 wire, pre-scaled by 1/world_size, with its state."""
# No `from __future__ import annotations`: DDP compares the hook's return annotation to the real
# torch.futures.Future[torch.Tensor] object, and a string would not match.

import torch

from ._state import CompressionState, compression_hook

__all__ = ["FP16State", "fp16_hook"]


class FP16State(CompressionState):
    """Hold the FP16 hook's state: the rounding-error residual by parameter name (error feedback
    on).

    Unlike torch's ``fp16_compress_hook``, which casts first and divides by the world size
    after (so a value the average could hold already overflows in the cast) and keeps no
    residual, values here are divided in FP32 BEFORE the cast and the sum, and the cast's
    rounding error is fed back.

    Args:
        process_group: the group to average over (None: the default group).
        config: a CompressionConfig with method "fp16" (wire_dtype "fp16" or "bf16"); or its
            fields as keywords, e.g. ``wire_dtype="bf16", error_feedback=False``.
        grad_scaler: the GradScaler producing the gradients, if any.

    Example::

        >>> ddp.register_comm_hook(FP16State(None), fp16_hook)
    """

    _method = "fp16"


def fp16_hook(state: FP16State, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket over a half-precision wire; return a Future of the FP32 average.

    Example::

        >>> ddp.register_comm_hook(FP16State(None, wire_dtype="bf16"), fp16_hook)
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"fp16_hook: state must be an FP16State, got {type(state).__name__}")
    return compression_hook(state, bucket)
