"""Coarse-grained sparse communication (CSC) with error feedback and DGC momentum correction.

Per flat buffer (one bucket), on every rank::

    grad = grad scaled to norm <= clip_norm / sqrt(n) per parameter   (only with clip_norm set)
    grad += wd * param                      (momentum correction: the optimizer's weight decay)
    v = grad + residual                     (momentum correction: u = m*u + grad; v = residual + u,
                                            m and Nesterov the optimizer's at this step, sgd.py)
                                            into the spare residual buffer; grad zeroed, same pass
    norms = per-chunk L1 (or squared L2) of v, with the dense parameters' elements left out
    stage 1: SUM-allreduce [norms | dense part if its wire dtype is fp32 | FP16: bound of |v|]
    idx = top ceil(density * nchunks) chunks of the reduced norms (ties to the lower index)
    stage 2: SUM-allreduce [packed chunks of v*2^e/n | dense part of v/n if in the wire dtype]
                                            (2^e agreed from the bound: wire_scale.py)
    out = the reduced chunks in place, zeros elsewhere, the dense part everywhere it belongs
    residual = v where not sent; the wire rounding error (v - upcast(local)*n) where sent

Cost: with error feedback the bucket is read and written once per step (v goes to the spare
residual while the bucket is zeroed, and after the collectives only the k sent chunks are
written: `kernels.unpack_sent`), not twice (v back into the bucket, then a full scatter pass);
ResNet-50 on one thread: 38 -> 22 ms of CPU per step (`bench_compression --budget-only`).

Dense parameters inside a mixed bucket (dim <= 1 or numel < min_numel: biases, BN) are gathered
by one precomputed index into a small tail appended to a stage that already runs: no extra
collective and no copy of the bucket, only of the D dense elements (54,120 for ResNet-50). Their
elements are masked out of the chunk norms (the norms of the few chunks that hold any are
recomputed over their sparse elements only) so selection ranks only what is sparsified.

Non-finite input (an FP16 loss-scale overflow) is decided from REDUCED tensors, so every rank
takes the same branch: if the reduced norms or the reduced payload hold inf/NaN, the residual and
momentum are left as they were (new values go to spare buffers, committed by a swap; a step with
any non-finite bucket undoes the other buckets' swaps at end_step), and the output is
what every rank received (non-finite somewhere) with zeros elsewhere, so GradScaler sees inf/NaN and
skips the step on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gradientflow import kernels

from ..engine.stages import StageGen
from . import wire_scale
from .base import Compressor
from .layout import Layout
from .registry import register_compressor
from .selection import select_pool
from .sgd import SGDTerms

__all__ = ["CSCCompressor"]


@dataclass(frozen=True)
class _Plan:
    """Per-layout precomputation: where the dense elements are and which chunks they touch."""

    dense_idx: torch.Tensor | None  # positions of the dense parameters' elements (int64, D)
    mixed_chunks: torch.Tensor | None  # chunks holding any dense element (int64)
    mixed_keep: torch.Tensor | None  # True where that chunk's element is a sparse one (bool, M x C)

    @property
    def dense_numel(self) -> int:
        return 0 if self.dense_idx is None else self.dense_idx.numel()


def _build_plan(layout: Layout, config, device: torch.device) -> _Plan:
    dense = [
        (s, e)
        for (name, s, e), shape in zip(layout.slices(), layout.shapes)
        if config.is_dense_param(shape)
    ]
    dense = [(s, e) for s, e in dense if e > s]
    if not dense:
        return _Plan(None, None, None)
    c, n = config.chunk_size, layout.numel
    dense_idx = torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in dense])
    is_dense = torch.zeros(n, dtype=torch.bool)
    is_dense[dense_idx] = True
    mixed = torch.unique(dense_idx // c)
    pos = (mixed[:, None] * c + torch.arange(c)[None, :]).reshape(-1)
    inside = pos < n
    pos = pos.clamp(max=n - 1)
    keep = (inside & ~is_dense[pos]).view(-1, c)
    return _Plan(dense_idx.to(device), mixed.to(device), keep.contiguous().to(device))


def _chunk_rows(t: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, int]:
    """Return the view of t's full chunks as rows and the number of full chunks."""
    full = t.numel() // chunk_size
    return t[: full * chunk_size].view(full, chunk_size), full


def _write_chunks(
    dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, chunk_size: int
) -> None:
    """dst's chunk idx[j] = rows[j] (cut at the end of dst); rows float32 (k x C). Rare path
    only."""
    body, full = _chunk_rows(dst, chunk_size)
    is_full = idx < full
    if bool(is_full.any()):
        body[idx[is_full]] = rows[is_full]
    if bool((~is_full).any()):
        tail = dst.numel() - full * chunk_size
        dst[full * chunk_size:] = rows[~is_full][0, :tail]


def _fill_chunks(
    dst: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, chunk_size: int
) -> None:
    """dst's chunk idx[j] = values[j] everywhere in it (values float32, one per chunk)."""
    rows = values[:, None].expand(-1, chunk_size).contiguous()
    _write_chunks(dst, idx, rows, chunk_size)


class _Bucket:
    """One buffer of a CSC batch, carried from its norms to its commit (CSCCompressor)."""

    __slots__ = ("flat", "layout", "numel", "nch", "plan", "d", "eligible", "slots", "mem", "v",
                 "dense_v", "dense_in_1", "dense_in_2", "dense_own", "dense_local",
                 "dense_reduced", "scaled", "stage1", "ws", "reduced_norms", "bad", "idx", "k",
                 "local", "reduced2")

    def __init__(self, flat: torch.Tensor, layout: Layout, numel: int, nch: int) -> None:
        self.flat, self.layout, self.numel, self.nch = flat, layout, numel, nch
        self.plan = self.mem = self.v = self.dense_v = self.dense_local = None
        self.dense_reduced = self.stage1 = self.ws = self.reduced_norms = self.idx = None
        self.local = self.reduced2 = None
        self.d = self.k = 0
        self.eligible = self.dense_in_1 = self.dense_in_2 = self.dense_own = False
        self.scaled = self.bad = False
        self.slots: tuple = ()


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors back to back (a lone one as it is: no copy)."""
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype)


@register_compressor("csc")
class CSCCompressor(Compressor):
    """Send the top ceil(density x chunks) chunks of grad + residual, agreed through allreduced
    chunk norms."""

    uses_warmup = True

    @classmethod
    def applies_momentum(cls, config) -> bool:
        """Under momentum correction the velocity lives here, not in the optimizer."""
        return bool(config.momentum_correction)

    def __init__(self, config, world_size: int) -> None:
        super().__init__(config, world_size)
        self._plans: dict[tuple[Layout, torch.device], _Plan] = {}
        # The momentum the config gives, for buffers reduced without an optimizer's settings.
        self._own_terms = SGDTerms(config.momentum_value, config.nesterov)
        # The stored velocity is SGD's momentum buffer times this (sgd.SGDTerms.velocity_factor).
        self._velocity_factor = self._own_terms.velocity_factor
        kernels.start_threads()  # on the building (main) thread

    def _plan(self, layout: Layout, device: torch.device) -> _Plan:
        key = (layout, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _build_plan(layout, self.config, device)
        return plan

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0,
               final: bool = False) -> StageGen:
        """Return the CSC StageGen for one buffer (2 collectives; see the module docstring)."""
        results = yield from self.reduce_many([flat], [layout], loss_scale=loss_scale,
                                              final=final)
        return results[0]

    def prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float = 1.0,
                terms: SGDTerms | None = None) -> "_Bucket":
        """v = grad + residual (+ momentum) and the chunk norms of one buffer, ahead of its
        batch (only spare buffers are written; see reduce_many). `terms`: the optimizer's
        momentum and weight decay for this step (None: the config's momentum, no decay)."""
        layout.check(flat, "CSCCompressor.prepare")
        return self._prepare(flat, layout, loss_scale, terms)

    def reduce_many(self, flats: Sequence[torch.Tensor], layouts: Sequence[Layout], *,
                    loss_scale: float = 1.0, final: bool = False,
                    prepared: Sequence["_Bucket | None"] | None = None) -> StageGen:
        """Return the CSC StageGen of a fused batch of buffers: 2 collectives for all of them.

        Each buffer is computed as alone (its own chunks, dense part and wire scale); their
        stage tensors travel back to back, and the chunks to send are chosen across the batch
        (config.selection "pool") or per buffer ("bucket"), from the reduced norms.
        """
        prepared = prepared or [None] * len(flats)
        for it, flat, layout in zip(prepared, flats, layouts):
            if it is None:  # a prepared buffer was checked by prepare()
                layout.check(flat, "CSCCompressor.reduce")
        cfg, n = self.config, self.world_size
        density = self.density_in_force()
        # Factor masking resets the velocity of stale chunks; at density 1 none is stale.
        mask = density < 1.0
        items = [it if it is not None else self._prepare(flat, layout, loss_scale, None)
                 for it, flat, layout in zip(prepared, flats, layouts)]
        live = [it for it in items if it.numel]
        if not live:
            return list(flats)

        # --- stage 1: every buffer's norms (+ dense part in fp32, + FP16 bound), back to back --
        reduced1 = yield from self._stage(_cat([it.stage1 for it in live]))
        for it, part in zip(live, reduced1.split([it.stage1.numel() for it in live])):
            part, it.ws = wire_scale.split_bound(part, it.scaled, n, cfg.torch_wire_dtype)
            it.reduced_norms = part[:it.nch]
            if it.dense_in_1:
                it.dense_reduced = part[it.nch:]
            it.bad = not kernels.all_finite(part)
        chosen = select_pool([it.reduced_norms for it in live], density, quota=cfg.selection,
                             eligible=[it.eligible and not it.bad for it in live])
        for it, idx in zip(live, chosen):
            it.idx = idx
            self.stats.add_bucket(numel=it.numel, chunks_sent=idx.numel(), chunks_total=it.nch,
                                  elements_sent_dense=it.d, density=density,
                                  warmup=self.in_warmup())

        # --- stage 2: the chosen chunks pre-scaled by 2^e/n (+ the dense part in the wire dtype)
        wire_dtype, dense_dtype = cfg.torch_wire_dtype, cfg.torch_dense_wire_dtype
        sends = [self._pack(it) for it in live]
        own = [it for it in live if it.dense_own and not it.bad]
        send = _cat(sends, wire_dtype)
        if send.numel() == 0 and not own:
            # Nothing chosen and no dense part (the same on every rank: decided from the
            # reduced norms): no second collective.
            for it in live:
                it.reduced2 = send
                self._finish(it, mask)
            return list(flats)
        reduced2 = yield from self._stage(send, final=final and not own)
        for it, part in zip(live, reduced2.split([t.numel() for t in sends])):
            it.reduced2 = part
            if it.dense_in_2 and not it.bad:
                it.dense_reduced = part[it.k * cfg.chunk_size:]
        if own:
            # A dense dtype that is neither fp32 nor the chunks' wire dtype: its own stage.
            thirds = [kernels.cast_scaled(it.dense_v, 1.0 / n, dense_dtype) for it in own]
            for it, t in zip(own, thirds):
                it.dense_local = t.clone()
            reduced3 = yield from self._stage(_cat(thirds, dense_dtype), final=final)
            for it, part in zip(own, reduced3.split([t.numel() for t in thirds])):
                it.dense_reduced = part
        for it in live:
            self._finish(it, mask)
        return list(flats)

    def _prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float,
                 terms: SGDTerms | None) -> "_Bucket":
        """v = grad + residual (+ momentum) and the chunk norms of one buffer, and its stage-1
        tensor; nothing persistent is modified yet (but a velocity rescaled for Nesterov)."""
        cfg, n = self.config, self.world_size
        c, numel = cfg.chunk_size, flat.numel()
        it = _Bucket(flat, layout, numel, kernels.nchunks_of(numel, c))
        if numel == 0:
            return it
        plan = it.plan = self._plan(layout, flat.device)
        d = it.d = plan.dense_numel
        # A bucket of dense parameters only (e.g. all BN) has no chunk worth sending.
        it.eligible = d != numel
        wire_dtype, dense_dtype = cfg.torch_wire_dtype, cfg.torch_dense_wire_dtype
        if cfg.clip_norm is not None:
            self.clip_local(flat, layout, loss_scale)
        terms = self._own_terms if terms is None else terms
        # Weight decay enters after clipping and before the momentum, as in SGD (and DGC).
        terms.add_decay(flat)
        # Each state slot has a spare: the new values are written there and committed by a swap,
        # so a step found non-finite later (even in another bucket) can be undone.
        ef, mc = cfg.error_feedback, cfg.momentum_correction
        slots = it.slots = (("residual", "_residual_spare") if ef else ()) + (
            ("momentum", "_momentum_spare") if mc else ()
        )
        if mc:
            self._align_velocity(terms)
        mem = it.mem = self.memory.get(layout, slots, flat, loss_scale) if slots else {}
        residual = mem.get("residual")
        mom_kw = {}
        if mc:
            mom_kw = dict(momentum=mem["momentum"], momentum_out=mem["_momentum_spare"],
                          m=terms.momentum, nesterov=terms.nesterov)
        if ef:
            # v goes straight into the spare residual (the new residual wherever nothing is sent)
            # and the bucket is zeroed while it is in cache: after the collectives only the k sent
            # chunks are written (unpack_sent), not a second full pass over the bucket.
            v = it.v = mem["_residual_spare"]
            norms = kernels.chunk_norms(
                flat, residual, c, cfg.norm, v_out=v, zero_grad=True, **mom_kw
            )
        else:
            it.v = flat
            norms = kernels.chunk_norms(flat, residual, c, cfg.norm, **mom_kw)
        if d:
            it.dense_v = it.v.index_select(0, plan.dense_idx)
            kernels.masked_chunk_norms(
                it.v, plan.mixed_chunks, plan.mixed_keep, c, cfg.norm, out=norms
            )
        # stage 1 carries the dense part when it travels in fp32, like the norms
        it.dense_in_1 = d > 0 and dense_dtype == torch.float32
        it.dense_in_2 = d > 0 and dense_dtype == wire_dtype and not it.dense_in_1
        it.dense_own = d > 0 and not it.dense_in_1 and not it.dense_in_2
        stage1 = norms
        if it.dense_in_1:
            stage1 = torch.cat([norms, it.dense_v * (1.0 / n)])
            it.dense_local = stage1[it.nch:].clone()
        # FP16: the chunks' power of two, agreed by a bound sent with the norms (wire_scale.py).
        it.scaled = it.eligible and wire_scale.needs_scale(wire_dtype)
        if it.scaled:
            stage1 = torch.cat([stage1, wire_scale.norms_bound(norms, cfg.norm, it.dense_v)])
        it.stage1 = stage1
        return it

    def _align_velocity(self, terms: SGDTerms) -> None:
        """Keep the stored velocity in the form this step's kernel call expects.

        Nesterov's velocity is stored as m * SGD's buffer: when the momentum changes (a
        schedule) or Nesterov is switched, every layout's velocity is rescaled once, so the
        next step is SGD's with the new momentum (the first buffer of a step does it for all:
        no commit of the step has happened yet).
        """
        want, have = terms.velocity_factor, self._velocity_factor
        if want != have:
            if have:
                self.memory.scale_slot("momentum", want / have)
            self._velocity_factor = want

    def import_velocity(self, buffers: dict[str, torch.Tensor]) -> None:
        """Take SGD momentum buffers (by parameter name, e.g. from a dense run's checkpoint) as
        this rank's velocity; between steps. At density 1 every rank holding the buffer is the
        dense run's buffer on average."""
        self.memory.put("momentum", {n: b * self._velocity_factor for n, b in buffers.items()})

    def state_dict(self) -> dict:
        """The base state, and what the stored velocity is SGD's buffer times."""
        return {**super().state_dict(), "velocity_factor": self._velocity_factor}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by `state_dict` (one without a velocity factor: the config's)."""
        super().load_state_dict(state)
        self._velocity_factor = float(state.get("velocity_factor",
                                                self._own_terms.velocity_factor))

    def _pack(self, it: "_Bucket") -> torch.Tensor:
        """One buffer's stage-2 tensor: its chosen chunks, then its dense part in the wire dtype.

        A buffer found non-finite sends nothing more (the same on every rank)."""
        cfg, n = self.config, self.world_size
        c, wire_dtype = cfg.chunk_size, cfg.torch_wire_dtype
        if it.bad:
            return torch.empty(0, dtype=wire_dtype, device=it.flat.device)
        k = it.k = it.idx.numel()
        send = torch.empty(k * c + (it.d if it.dense_in_2 else 0), dtype=wire_dtype,
                           device=it.flat.device)
        kernels.pack_chunks(it.v, it.idx, c, it.ws.pre, wire_dtype, out=send[: k * c])
        if it.dense_in_2:
            kernels.cast_scaled(it.dense_v, 1.0 / n, wire_dtype, out=send[k * c:])
        # The local copy gives the exact rounding error (of the cast and of the 1/n pre-scale).
        if cfg.error_feedback or it.dense_in_2:
            it.local = send.clone()
        if it.dense_in_2:
            it.dense_local = it.local[k * c:]
        return send

    def _finish(self, it: "_Bucket", mask: bool) -> None:
        """Write one buffer's average in place, and commit its residual and momentum.

        mask: apply factor masking to the sent chunks' momentum (False in a step at density 1,
        which sends every chunk)."""
        cfg, n = self.config, self.world_size
        c, flat, plan = cfg.chunk_size, it.flat, it.plan
        if it.bad:
            self._non_finite(flat, plan, it.reduced_norms, None, None, it.dense_reduced)
            return
        idx, k, reduced2 = it.idx, it.k, it.reduced2
        # The dense part was checked with its stage (stage 1, or inside reduced2) unless it had
        # its own.
        if not kernels.all_finite(reduced2) or (
            it.dense_own and not kernels.all_finite(it.dense_reduced)
        ):
            self._non_finite(flat, plan, it.reduced_norms, idx, reduced2[: k * c],
                             it.dense_reduced)
            return
        ef, mc, d = cfg.error_feedback, cfg.momentum_correction, it.d
        new_residual = it.mem.get("_residual_spare")
        # --- out (in place over v) and the new residual in one pass, then the dense part --------
        if ef:
            # flat is zero and new_residual holds v: only the sent chunks change.
            kernels.unpack_sent(
                flat, new_residual, reduced2[: k * c], it.local[: k * c], idx, c, it.ws.post,
                it.ws.err
            )
        else:
            kernels.unpack_update(
                flat, None, reduced2[: k * c], None, idx, c, it.ws.post, it.ws.err, out=flat
            )
        if d:
            kernels.dense_scatter(flat, new_residual if ef else None, plan.dense_idx,
                                  it.dense_reduced, it.dense_local, it.dense_v, 1.0, float(n))
        if mc and mask:
            u = it.mem["_momentum_spare"]
            # Factor masking (DGC): the velocity of what was sent starts again from zero; dense
            # parameters are sent every step, so they keep theirs (plain heavy-ball momentum).
            # A step at density 1 (the warm-up's dense stage) sends every chunk, none of them
            # stale, so it masks nothing: it is then SGD with momentum on the average (up to the
            # wire's rounding, which stays in the residual), as dense training would be.
            dense_u = u.index_select(0, plan.dense_idx) if d else None
            _fill_chunks(u, idx, u.new_zeros(idx.numel()), c)
            if d:
                u.index_copy_(0, plan.dense_idx, dense_u)
        if it.slots:
            self.memory.commit(it.layout, tuple(zip(it.slots[::2], it.slots[1::2])))

    def _non_finite(
        self, flat, plan: _Plan, reduced_norms, idx, reduced_chunks, dense_reduced
    ) -> torch.Tensor:
        """Output what every rank received (non-finite somewhere), zeros elsewhere; leave residual
        and momentum alone."""
        c = self.config.chunk_size
        self._step_non_finite = True
        flat.zero_()
        bad = ~torch.isfinite(reduced_norms)
        if bool(bad.any()):
            _fill_chunks(flat, bad.nonzero().view(-1), reduced_norms[bad].to(torch.float32), c)
        if idx is not None:
            _write_chunks(flat, idx, reduced_chunks.to(torch.float32).view(-1, c), c)
        if dense_reduced is not None:
            flat.index_copy_(0, plan.dense_idx, dense_reduced.to(torch.float32))
        return flat
