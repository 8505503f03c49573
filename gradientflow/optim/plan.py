"""The partition plan: which gradient elements travel together, fixed from the parameter order.

Leaf module (imports nothing of gradientflow but the Layout): a pure function of the parameters'
names, shapes, dtypes and devices, so every rank that wraps the same model builds the same plan
(the constructor checks that: plan_check.py).

Parameters are taken in registration order, which is the order a feed-forward model's next forward
consumes them (TicTac's TIC priority for a chain): partition 0 holds the first layer. Consecutive
parameters share a partition up to `partition_bytes`; a parameter larger than that is cut along its
first dimension into row blocks of about `partition_bytes` each (P3's slicing, ByteScheduler's
partitions), so the first layer's gradient is never stuck behind one large late tensor. A row block
keeps the parameter's trailing dimensions, so a compressor still sees a matrix, not a vector.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from gradientflow.compression.layout import Layout

__all__ = ["ParamSpec", "Segment", "Partition", "build_plan"]


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know of one trainable parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Segment:
    """Rows [row0, row1) of parameter `index` (the whole parameter when `whole`)."""

    index: int
    name: str  # the parameter's name, or "name#rows[a:b]" for a row block (keys residual memory)
    row0: int
    row1: int
    shape: tuple[int, ...]  # the segment's own shape
    whole: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This segment of a tensor shaped like the parameter (a view, no copy)."""
        return tensor if self.whole else tensor[self.row0:self.row1]


@dataclass(frozen=True)
class Partition:
    """One unit of communication: consecutive segments of one dtype on one device."""

    key: int
    segments: tuple[Segment, ...]
    dtype: torch.dtype
    device: torch.device

    # Cached: read on backward's thread for every partition submitted (the plan is immutable).
    @functools.cached_property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def params(self) -> tuple[int, ...]:
        """Indices of the parameters this partition touches (in order, each once)."""
        return tuple(dict.fromkeys(s.index for s in self.segments))

    def layout(self) -> Layout:
        """The Layout a compressor reduces this partition's flat buffer with."""
        return Layout.from_shapes((s.name, s.shape) for s in self.segments)


def build_plan(specs: Sequence[ParamSpec], partition_bytes: int) -> list[Partition]:
    """Group parameters (in the given order) into partitions of about `partition_bytes` each.

    Example::

        >>> specs = [ParamSpec("w", (4, 3), torch.float32, torch.device("cpu"))]
        >>> [p.numel for p in build_plan(specs, partition_bytes=24)]   # 2 rows of 12 bytes
        [6, 6]
    """
    if partition_bytes < 1:
        raise ValueError(f"build_plan: partition_bytes={partition_bytes} must be >= 1 byte")
    parts: list[list[Segment]] = []
    meta: list[tuple[torch.dtype, torch.device]] = []
    cur: list[Segment] = []
    cur_bytes = 0
    cur_meta = None

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            parts.append(cur)
            meta.append(cur_meta)
        cur, cur_bytes = [], 0

    for index, spec in enumerate(specs):
        nbytes = spec.nbytes
        m = (spec.dtype, spec.device)
        if nbytes > partition_bytes and len(spec.shape) >= 1 and spec.shape[0] > 1:
            # Too large for one partition: row blocks, each a partition of its own.
            close()
            rows = spec.shape[0]
            row_bytes = nbytes // rows
            per = max(1, partition_bytes // max(1, row_bytes))
            cur_meta = m
            for r0 in range(0, rows, per):
                r1 = min(rows, r0 + per)
                seg = Segment(index, f"{spec.name}#rows[{r0}:{r1}]", r0, r1,
                              (r1 - r0,) + tuple(spec.shape[1:]), False)
                parts.append([seg])
                meta.append(m)
            continue
        if cur and (cur_meta != m or cur_bytes + nbytes > partition_bytes):
            close()
        cur_meta = m
        cur.append(Segment(index, spec.name, 0, spec.shape[0] if spec.shape else 0,
                           tuple(spec.shape), True))
        cur_bytes += nbytes
    close()
    return [Partition(k, tuple(segs), dt, dev) for k, (segs, (dt, dev)) in
            enumerate(zip(parts, meta))]
