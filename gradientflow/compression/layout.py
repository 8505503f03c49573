"""The layout of a flat gradient buffer: which parameter lives where (by name, not by position)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Describe a flat buffer as consecutive parameters: names, offsets, numels and shapes.

    Names are what make state survive DDP's bucket rebuild and a restart: a bucket index or a
    tensor identity does not (PyTorch PR #48670). Hashable, so it keys per-layout caches.
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.offsets) == len(self.numels) == len(self.shapes) == n):
            raise ValueError(
                "Layout: names, offsets, numels and shapes must have one entry per parameter"
            )
        if len(set(self.names)) != n:
            raise ValueError(
                f"Layout: parameter names repeat in {self.names}; each parameter must appear once"
            )
        for name, off, numel, shape in zip(self.names, self.offsets, self.numels, self.shapes):
            if off < 0 or numel != math.prod(shape):
                raise ValueError(
                    f"Layout: parameter {name!r} has offset {off}, numel {numel} and shape "
                    f"{shape}, which disagree"
                )

    @classmethod
    def from_shapes(cls, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> "Layout":
        """Lay out parameters back to back in the given order (as DDP's buckets do)."""
        names, offsets, numels, shapes = [], [], [], []
        off = 0
        for name, shape in named_shapes:
            shape = tuple(int(s) for s in shape)
            numel = math.prod(shape)
            names.append(name)
            offsets.append(off)
            numels.append(numel)
            shapes.append(shape)
            off += numel
        return cls(tuple(names), tuple(offsets), tuple(numels), tuple(shapes))

    @classmethod
    def from_tensors(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "Layout":
        """Lay out these tensors back to back in the given order."""
        return cls.from_shapes((name, tuple(t.shape)) for name, t in named_tensors)

    @property
    def numel(self) -> int:
        """Elements covered: the end of the last parameter."""
        return max((o + n for o, n in zip(self.offsets, self.numels)), default=0)

    def check(self, flat: torch.Tensor, op: str) -> None:
        """Refuse a buffer that this layout does not describe, with a sentence saying why."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"{op}: the gradient buffer must be a 1-D contiguous tensor, got shape "
                f"{tuple(flat.shape)}"
            )
        if flat.dtype != torch.float32:
            raise ValueError(
                f"{op}: the gradient buffer has dtype {flat.dtype}; compression works on float32 "
                "gradients (keep FP32 master gradients and let the compressor choose the wire "
                "dtype)"
            )
        if flat.numel() != self.numel:
            raise ValueError(
                f"{op}: the buffer has {flat.numel()} elements but its layout ({len(self.names)} "
                "parameters, "
                f"first {self.names[:1]}) covers {self.numel}; pass the layout of this exact buffer"
            )

    def slices(self) -> Iterable[tuple[str, int, int]]:
        """Yield (name, start, end) for every parameter."""
        for name, off, numel in zip(self.names, self.offsets, self.numels):
            yield name, off, off + numel
