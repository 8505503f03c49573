"""The parts of a CSC step, each a small value with one owner: the plan, the dense route, and
what one buffer carries from its norms to its commit.

- `Plan` (per layout and device, built once, owned by the compressor): where the dense
  parameters' elements are and which chunks they touch.
- `DenseRoute` (one value per buffer): how its dense part travels.
- `Prepared` (made by `prepare`, owned by the batch): v, its norms and the stage-1 message.
  Nothing in it outlives the step: v and the new velocity sit in the layout's spare slots until
  the batch commits them.
- `Chosen` (made after stage 1): the agreed wire scale and the chunks to send.
- `Payload` (made for stage 2): what this rank sends, and the local copy that gives the exact
  rounding error.

Leaf module beside csc.py: it computes nothing but the plan.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .layout import Layout
from .wire_scale import TensorScale, WireScale

__all__ = ["Plan", "build_plan", "DenseRoute", "Prepared", "Chosen", "Payload"]


@dataclass(frozen=True)
class Plan:
    """Per-layout precomputation: where the dense elements are and which chunks they touch."""

    dense_idx: torch.Tensor | None  # positions of the dense parameters' elements (int64, D)
    mixed_chunks: torch.Tensor | None  # chunks holding any dense element (int64)
    mixed_keep: torch.Tensor | None  # True where that chunk's element is a sparse one (bool, M x C)

    @property
    def dense_numel(self) -> int:
        return 0 if self.dense_idx is None else self.dense_idx.numel()


def build_plan(layout: Layout, config, device: torch.device) -> Plan:
    """The Plan of `layout` under `config` (which parameters are sent dense), on `device`."""
    dense = [
        (s, e)
        for (name, s, e), shape in zip(layout.slices(), layout.shapes)
        if config.is_dense_param(shape)
    ]
    dense = [(s, e) for s, e in dense if e > s]
    if not dense:
        return Plan(None, None, None)
    c, n = config.chunk_size, layout.numel
    dense_idx = torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in dense])
    is_dense = torch.zeros(n, dtype=torch.bool)
    is_dense[dense_idx] = True
    mixed = torch.unique(dense_idx // c)
    pos = (mixed[:, None] * c + torch.arange(c)[None, :]).reshape(-1)
    inside = pos < n
    pos = pos.clamp(max=n - 1)
    keep = (inside & ~is_dense[pos]).view(-1, c)
    return Plan(dense_idx.to(device), mixed.to(device), keep.contiguous().to(device))


class DenseRoute(enum.Enum):
    """How a buffer's dense part (biases, norms: sent whole every step) travels."""

    NONE = "no dense part"
    WITH_NORMS = "float32, after the chunk norms in stage 1"
    WITH_CHUNKS = "in the chunks' wire dtype, after them in stage 2"
    OWN_STAGE = "in another dtype, in a third stage of its own"

    @classmethod
    def of(cls, dense_numel: int, dense_dtype: torch.dtype,
           wire_dtype: torch.dtype) -> "DenseRoute":
        """The route of a dense part of `dense_numel` elements sent in `dense_dtype`."""
        if not dense_numel:
            return cls.NONE
        if dense_dtype == torch.float32:
            return cls.WITH_NORMS
        return cls.WITH_CHUNKS if dense_dtype == wire_dtype else cls.OWN_STAGE


@dataclass(eq=False)
class Prepared:
    """One buffer after prepare (owned by its batch; see the module docstring)."""

    flat: torch.Tensor
    layout: Layout
    nch: int
    plan: Plan | None = None
    route: DenseRoute = DenseRoute.NONE
    eligible: bool = False  # it has chunks worth sending (not dense parameters only)
    scaled: bool = False  # its stage 1 ends with the FP16 bound (wire_scale.py)
    slots: tuple[str, ...] = ()  # memory slots, live and spare alternating
    mem: dict | None = None  # the layout's slot tensors (only spare ones written so far)
    v: torch.Tensor | None = None  # grad + residual (+ velocity)
    dense_v: torch.Tensor | None = None  # v's dense elements (D)
    stage1: torch.Tensor | None = None  # [norms | dense part (WITH_NORMS) | bound (scaled)]
    dense_local: torch.Tensor | None = None  # WITH_NORMS: what this rank sends of its dense part

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def dense_numel(self) -> int:
        return 0 if self.plan is None else self.plan.dense_numel


@dataclass(frozen=True, eq=False)
class Chosen:
    """One buffer after stage 1: its reduced norms and dense part, the scale, the chunks."""

    reduced_norms: torch.Tensor
    ws: WireScale | TensorScale  # on a GPU the agreed scale stays there
    idx: torch.Tensor  # chunks to send, int64, ascending (the same on every rank)
    dense_reduced: torch.Tensor | None  # WITH_NORMS: the reduced dense part


@dataclass(frozen=True, eq=False)
class Payload:
    """One buffer's stage-2 message and its local copy (the exact rounding error)."""

    send: torch.Tensor  # [k chunks | dense part (WITH_CHUNKS)] in the wire dtype
    k: int
    local: torch.Tensor | None  # a copy of `send` (error feedback, or a dense part inside)
