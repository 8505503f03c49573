"""PowerSGD (Vogels et al. 2019): each gradient matrix travels as two rank-r factors, with error
feedback and a warm start.

Per flat buffer, on every rank, each matrix M (a parameter of shape (rows, *rest) viewed as
rows x cols, with the residual added) whose factors are worth it::

    P_i = M Q                          Q: cols x r, the same on every rank (kept between steps)
    stage 1: SUM-allreduce [every P_i / n | the dense part / n]
    P = orthonormal basis of the reduced P (QR: the same on every rank, from the same sum)
    Q_i = M^T P
    stage 2: SUM-allreduce [every Q_i / n]          -> Q = the average of the Q_i
    out = P Q^T                        (= P P^T times the average of the M: exact at full rank)
    residual = M - out                 (what the applied average did not carry: the paper's
                                        error feedback and torch's hook's, a subtraction)
    Q is kept for the next step (the warm start: one power iteration a step)

The residuals sum over ranks to the sum of the M minus n times the output, so no gradient mass
is lost (up to the wire's rounding of the sum). Vectors (biases, norms) and matrices whose
factors would not save `min_compression_rate` times their size travel dense in stage 1, as
torch's PowerSGD hook does. Stage tensors of every buffer of a fused batch travel back to back
(the generic fuse of engine.stages), so a batch of buckets makes two collectives.

The options are `PowerSGDOptions` below; `CompressionConfig(method="powersgd", rank=4)`.
Its wire is FP32 unless the config names another dtype (a half wire's rounding stays in the
residual).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..engine.stages import StageGen, fuse
from .base import Compressor
from .layout import Layout
from .registry import Options, register_compressor

__all__ = ["PowerSGDCompressor", "PowerSGDOptions"]


@dataclass(frozen=True)
class PowerSGDOptions(Options):
    """PowerSGD's options (validated at construction; see each field's reason)."""

    # Rank of the factors: the paper's ResNet-18/CIFAR runs reach full accuracy at rank 2-4;
    # the wire carries (rows + cols) x rank values per matrix instead of rows x cols.
    rank: int = 4
    # A matrix travels as factors only if they are this many times smaller than it; below, it
    # travels dense (torch's PowerSGD default, 2: small matrices gain little and lose accuracy).
    min_compression_rate: float = 2.0
    # Keep Q between steps (one power iteration a step, the paper's warm start); False draws
    # a fresh Q at every step.
    warm_start: bool = True
    # Steps sent dense before the factors start (torch's start_powerSGD_iter): the first steps
    # move the weights most. 0: factors from the first step.
    start_step: int = 0
    # Seed of the first Q (drawn alike on every rank, per parameter name).
    seed: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"CompressionConfig: rank={self.rank!r} must be an integer >= 1 "
                             "(the rank of the factors)")
        r = self.min_compression_rate
        if not isinstance(r, (int, float)) or not 0.0 <= float(r) < math.inf:
            raise ValueError(f"CompressionConfig: min_compression_rate={r!r} must be a finite "
                             "number >= 0 (0: every matrix travels as factors)")
        if not _is_int(self.start_step) or self.start_step < 0:
            raise ValueError(f"CompressionConfig: start_step={self.start_step!r} must be an "
                             "integer >= 0")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"CompressionConfig: seed={self.seed!r} must be an integer >= 0")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Matrix:
    """One parameter that travels as factors: where it lives in the buffer, its matrix shape."""

    name: str
    start: int
    rows: int
    cols: int
    rank: int

    @property
    def end(self) -> int:
        return self.start + self.rows * self.cols


@dataclass(frozen=True)
class _Plan:
    """Per layout: the matrices sent as factors, and the positions of everything sent dense."""

    matrices: tuple[_Matrix, ...]
    dense_idx: torch.Tensor  # int64 positions of the dense elements
    p_sizes: tuple[int, ...]  # elements of each matrix's P (rows x rank): stage 1's head
    q_sizes: tuple[int, ...]  # elements of each matrix's Q (cols x rank): stage 2


@dataclass(frozen=True)
class _Local:
    """One buffer's local work before its first collective (`prepare`): v = gradient + residual
    (in the spare slot), the matrices' views and starting Qs, stage 1's tensor."""

    factors: bool
    plan: _Plan
    v: torch.Tensor
    mats: list
    stage1: torch.Tensor
    local_dense: torch.Tensor | None  # stage 1's dense part as sent (a rounding wire's EF)


def _build_plan(layout: Layout, opts: PowerSGDOptions, factors: bool) -> _Plan:
    mats, dense = [], []
    for (name, start, end), shape in zip(layout.slices(), layout.shapes):
        if end == start:
            continue
        if factors and len(shape) >= 2:
            rows = shape[0]
            cols = (end - start) // rows
            r = min(opts.rank, rows, cols)
            if (rows + cols) * r * float(opts.min_compression_rate) < rows * cols:
                mats.append(_Matrix(name, start, rows, cols, r))
                continue
        dense.append(torch.arange(start, end, dtype=torch.int64))
    idx = torch.cat(dense) if dense else torch.empty(0, dtype=torch.int64)
    return _Plan(tuple(mats), idx, tuple(m.rows * m.rank for m in mats),
                 tuple(m.cols * m.rank for m in mats))


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of `p` (rows x r, rows >= r), by QR: the same on
    every rank for the same input."""
    return torch.linalg.qr(p, mode="reduced").Q


def orthonormalize_many(ps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`orthonormalize` of each matrix, the matrices of one shape in one batched QR: a model's
    factors come in a few shapes, and a QR call's fixed cost outweighs its work at rank r."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(ps):
        groups.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
    out: list = [None] * len(ps)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = orthonormalize(ps[idx[0]])
            continue
        qs = torch.linalg.qr(torch.stack([ps[i] for i in idx]), mode="reduced").Q
        for i, q in zip(idx, qs.unbind(0)):
            out[i] = q
    return out


@register_compressor("powersgd", options=PowerSGDOptions, wire_dtype="fp32")
class PowerSGDCompressor(Compressor):
    """Send each large gradient matrix as two rank-r factors (P, then Q), with error feedback."""

    # Each bucket's factors go as soon as it is ready (docs/DECISIONS.md: measured against
    # fusing a step's buckets into one op).
    fuses_buckets = False

    def __init__(self, config, world_size: int) -> None:
        super().__init__(config, world_size)
        # Parameter name -> Q (cols x r, float32), the same on every rank; the warm start.
        self._q: dict[str, torch.Tensor] = {}
        # This step's new Qs: kept by end_step only if the step reduced to finite values.
        self._q_next: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[Layout, torch.device, bool], _Plan] = {}

    def _plan(self, layout: Layout, device: torch.device, factors: bool) -> _Plan:
        key = (layout, device, factors)
        plan = self._plans.get(key)
        if plan is None:
            plan = _build_plan(layout, self.config.options, factors)
            plan = self._plans[key] = replace(plan, dense_idx=plan.dense_idx.to(device))
        return plan

    def _q_of(self, m: _Matrix, device: torch.device) -> torch.Tensor:
        """The Q this step starts from: the kept one, or one drawn alike on every rank."""
        opts = self.config.options
        q = self._q.get(m.name) if opts.warm_start else None
        if q is not None and q.shape == (m.cols, m.rank):
            if self.config.torch_wire_dtype == torch.float32:
                return q.to(device)  # P is orthonormalised after the sum: Q's scale is moot
            # Orthonormal again on a half wire: the same span (so the same output), but
            # P = M Q then stays at the scale of M, where the kept average Q would square it
            # (a half wire overflows).
            return orthonormalize(q.to(device))
        salt = zlib.crc32(m.name.encode()) + (0 if opts.warm_start else self.step << 32)
        gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + salt)
        return orthonormalize(torch.randn(m.cols, m.rank, generator=gen)).to(device)

    # --- the op -----------------------------------------------------------------------------------
    def prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float = 1.0,
                terms=None) -> _Local | None:
        """Stage 1's local work ahead of the batch (the engine runs it while the batch's round
        is open): v into the spare slot, P_i = M Q; nothing kept across steps changes."""
        layout.check(flat, "PowerSGDCompressor.prepare")
        return self._local(flat, layout, loss_scale) if flat.numel() else None

    def _local(self, flat: torch.Tensor, layout: Layout, loss_scale: float) -> _Local:
        cfg, n = self.config, self.world_size
        factors = self.step >= cfg.options.start_step
        plan = self._plan(layout, flat.device, factors)
        if cfg.error_feedback:
            mem = self.memory.get(layout, ("residual", "_residual_spare"), flat, loss_scale)
            v = torch.add(flat, mem["residual"], out=mem["_residual_spare"])
        else:
            v = flat
        mats = [v[m.start:m.end].view(m.rows, m.cols) for m in plan.matrices]
        qs = [self._q_of(m, flat.device) for m in plan.matrices]
        # stage 1: P_i = M Q for every matrix, and the dense part, all pre-scaled by 1/n,
        # written in place into one tensor (no per-matrix temporaries and no concatenation)
        p_end = sum(plan.p_sizes)
        stage1 = torch.empty(p_end + plan.dense_idx.numel(), dtype=v.dtype, device=v.device)
        for m, mat, q, out in zip(plan.matrices, mats, qs, stage1[:p_end].split(plan.p_sizes)):
            torch.matmul(mat, q, out=out.view(m.rows, m.rank))
        torch.index_select(v, 0, plan.dense_idx, out=stage1[p_end:])
        stage1 = stage1.mul_(1.0 / n).to(cfg.torch_wire_dtype)
        # The dense part's error feedback needs what was sent only where the wire rounds it:
        # on a wire of the buffer's own dtype the values themselves were sent.
        local_dense = (stage1[p_end:].clone()
                       if cfg.error_feedback and stage1.dtype != v.dtype else None)
        return _Local(factors, plan, v, mats, stage1, local_dense)

    def reduce_many(self, flats: Sequence[torch.Tensor], layouts: Sequence[Layout], *,
                    loss_scale: float = 1.0, final: bool = False,
                    prepared: Sequence[_Local | None] | None = None) -> StageGen:
        """The buffers' StageGens fused stage by stage (engine.stages.fuse), each starting from
        what `prepare` computed ahead, where it ran."""
        prepared = prepared or [None] * len(flats)
        return (yield from fuse([self.reduce(f, lay, loss_scale=loss_scale, final=final,
                                             prepared=p)
                                 for f, lay, p in zip(flats, layouts, prepared)]))

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0,
               final: bool = False, prepared: _Local | None = None) -> StageGen:
        """Return the StageGen of one buffer: 2 collectives (1 when nothing travels as factors);
        see the module docstring. `prepared`: this buffer's `prepare`, if it ran."""
        layout.check(flat, "PowerSGDCompressor.reduce")
        if flat.numel() == 0:
            return flat
        n, ef = self.world_size, self.config.error_feedback
        wire = self.config.torch_wire_dtype
        local = prepared if prepared is not None else self._local(flat, layout, loss_scale)
        plan, v, mats = local.plan, local.v, local.mats
        local_dense = local.local_dense
        self.stats.add_bucket(numel=flat.numel(), elements_sent_dense=plan.dense_idx.numel(),
                              warmup=not local.factors)
        reduced1 = yield from self._stage(local.stage1, final=final and not mats)
        finite = [torch.isfinite(reduced1).all()]
        *p_parts, dense_avg = reduced1.split([*plan.p_sizes, plan.dense_idx.numel()])

        # --- stage 2: Q_i = M^T P for every matrix, pre-scaled by 1/n -----------------------------
        if mats:
            ps = orthonormalize_many([part.float().view(m.rows, m.rank)
                                      for part, m in zip(p_parts, plan.matrices)])
            stage2 = torch.empty(sum(plan.q_sizes), dtype=v.dtype, device=v.device)
            for m, mat, p, out in zip(plan.matrices, mats, ps, stage2.split(plan.q_sizes)):
                torch.matmul(mat.t(), p, out=out.view(m.cols, m.rank))
            stage2 = stage2.mul_(1.0 / n).to(wire)
            reduced2 = yield from self._stage(stage2, final=final)
            finite.append(torch.isfinite(reduced2).all())
            # One copy of the reduced Qs: kept for the next step, not views of the engine's
            # buffer.
            kept = reduced2.float() if reduced2.dtype != torch.float32 else reduced2.clone()
            for m, mat, p, q_avg in zip(plan.matrices, mats, ps, kept.split(plan.q_sizes)):
                q_avg = q_avg.view(m.cols, m.rank)
                out = flat[m.start:m.end].view(m.rows, m.cols)
                # The average straight into the buffer: without error feedback `mat` is a view
                # of it too, but read no more (its Q_i has been sent).
                torch.matmul(p, q_avg.t(), out=out)
                if ef:  # what the average did not carry, in place: one pass, no second product
                    mat.sub_(out)
                self._q_next[m.name] = q_avg

        # --- the dense part's average in place, the residual committed ----------------------------
        if plan.dense_idx.numel():
            flat.index_copy_(0, plan.dense_idx, dense_avg.float())
            if ef and local_dense is None:  # the wire sent the values themselves
                v.index_fill_(0, plan.dense_idx, 0.0)
            elif ef:  # the dense part's rounding error on the wire
                v.index_copy_(0, plan.dense_idx,
                              v.index_select(0, plan.dense_idx) - local_dense.float() * n)
        if ef:
            self.memory.commit(layout, (("residual", "_residual_spare"),))
        ok = finite[0] if len(finite) == 1 else torch.stack(finite).all()
        self._note_finite(ok)
        # A non-finite batch shows in its output, so GradScaler skips the step on every rank.
        head = flat[:1]
        head.copy_(torch.where(ok, head, torch.full_like(head, math.nan)))
        return flat

    def _close_step(self, non_finite: bool) -> None:
        """Keep this step's Qs for the next (the warm start), unless the step is undone."""
        if not non_finite:
            self._q.update(self._q_next)
        self._q_next = {}

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The base state and the kept Qs by parameter name (the same on every rank)."""
        return {**super().state_dict(),
                "powersgd_q": {k: q.detach().cpu().clone() for k, q in self._q.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by `state_dict` (without Qs: drawn again at the next step)."""
        super().load_state_dict(state)
        kept = state.get("powersgd_q") or {}
        self._q = {k: q.detach().clone().float() for k, q in kept.items()}
        self._q_next = {}
