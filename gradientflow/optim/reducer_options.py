"""The options of a gradient reducer, validated once when it is built (ReducerOptions), and how
the ranks' gradients combine (ReduceOp)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from gradientflow.compression import CompressionConfig

__all__ = ["ReduceOp", "ReducerOptions"]

PREFIX = "gradientflow.DistributedOptimizer"


class ReduceOp(enum.Enum):
    """How gradients are combined across ranks (Horovod's hvd.Average / hvd.Sum)."""

    Average = "average"
    Sum = "sum"


@dataclass(frozen=True)
class ReducerOptions:
    """The validated options of one reducer (fixed for its lifetime)."""

    # --- tuned by the user ---
    compression: CompressionConfig | None  # None: the dense average in the gradients' dtype
    backward_passes_per_step: int = 1
    op: ReduceOp = ReduceOp.Average
    gradient_predivide_factor: float = 1.0
    # True: TicTac's order among the partitions one round agrees (each is then agreed in rounds
    # whatever its size). False, the default: FIFO, each partition a plain async allreduce routed
    # as any other; no benchmark has shown priority to pay (docs/DECISIONS.md, "priority").
    priority: bool = False
    # 25 MiB, DDP's bucket size. Each partition costs a message (small ones fuse into one per
    # round), so many small partitions cost more than ordering buys (docs/DECISIONS.md,
    # "partition size"). A model with few large layers wants smaller partitions for priority
    # to reorder anything (the overlap benchmark uses one per layer).
    partition_bytes: int = 25 << 20
    sparse_as_dense: bool = False

    def __post_init__(self) -> None:
        b = self.backward_passes_per_step
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{PREFIX}: backward_passes_per_step={b!r} must be an integer >= 1")
        if not isinstance(self.op, ReduceOp):
            raise ValueError(f"{PREFIX}: op={self.op!r} must be gradientflow.Average or "
                             "gradientflow.Sum")
        f = self.gradient_predivide_factor
        if not isinstance(f, (int, float)) or not f > 0:
            raise ValueError(f"{PREFIX}: gradient_predivide_factor={f!r} must be a number > 0")
        if f != 1.0 and self.op is not ReduceOp.Average:
            raise ValueError(f"{PREFIX}: gradient_predivide_factor={f} only applies to "
                             "op=Average (as in Horovod); leave it at 1.0 with op=Sum")
        p = self.partition_bytes
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"{PREFIX}: partition_bytes={p!r} must be an integer >= 1 "
                             "(bytes per partition, e.g. 1 << 20)")
