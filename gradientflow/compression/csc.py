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
written: `kernels.unpack_sent`), not twice (v back into the bucket, then a full scatter pass)
(docs/DECISIONS.md, "one pass over the bucket").

Dense parameters inside a mixed bucket (dim <= 1 or numel < min_numel: biases, BN, small
convolutions) are gathered by one precomputed index into a tail appended to a stage that already
runs: no extra collective and no copy of the bucket, only of the D dense elements (a few per
thousand of a large model, a few per hundred of a small one). Their elements are masked out of
the chunk norms (the norms of the few chunks that hold any are recomputed over their sparse
elements only) so selection ranks only what is sparsified.

Non-finite input (an FP16 loss-scale overflow) is decided from REDUCED tensors, so every rank
decides alike, and on the device: the batch's finiteness is a device flag, the step runs as
usual (a non-finite chunk ranks first, so it is sent and every rank receives it), each output
of a non-finite batch is made to show it (GradScaler then skips the step on every rank), and the
flags are read once, at end_step, which undoes the step's commits of residual and velocity
(new values go to spare buffers, committed by a swap). On a GPU the FP16 wire's power of two
stays on the device too (`wire_scale.TensorScale`, read by the kernels), so a step has no host
read per stage ("pool" selection still reads each bucket's share of the chunks).

Rule: `prepare` (which the engine may run before the batch is agreed) changes no value that
outlives the step. It writes the layout's spare slots only; the values kept (residual,
velocity as SGD's buffer, counters, statistics) are as they were, though it may re-express
them in other units or a new layout (the loss scale, the velocity factor, DDP's re-bucketing),
which leaves every value unchanged (tests/compression/test_prepare_rule.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gradientflow import kernels

from ..engine.stages import StageGen
from . import wire_scale
from .base import Compressor
from .config import WIRE_DTYPES
from .csc_options import CSCOptions
from .csc_parts import Chosen, DenseRoute, Payload, Plan, Prepared, build_plan
from .layout import Layout
from .registry import register_compressor
from .selection import select_pool
from .sgd import SGDTerms

__all__ = ["CSCCompressor"]


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors back to back (a lone one as it is: no copy)."""
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors) if tensors else torch.empty(0, dtype=dtype)


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on t's device: no inf or NaN in t (nothing read back by the host)."""
    return torch.isfinite(t).all()


@register_compressor("csc", options=CSCOptions)
class CSCCompressor(Compressor):
    """Send the top ceil(density x chunks) chunks of grad + residual, agreed through allreduced
    chunk norms."""

    @classmethod
    def applies_momentum(cls, config) -> bool:
        """Under momentum correction the velocity lives here, not in the optimizer."""
        return bool(config.momentum_correction)

    def __init__(self, config, world_size: int) -> None:
        super().__init__(config, world_size)
        self._plans: dict[tuple[Layout, torch.device], Plan] = {}
        # The momentum the config gives, for buffers reduced without an optimizer's settings.
        self._own_terms = SGDTerms(config.momentum_value, config.nesterov)
        # The stored velocity is SGD's momentum buffer times this (sgd.SGDTerms.velocity_factor).
        self._velocity_factor = self._own_terms.velocity_factor
        # The dtype of the dense part of a bucket (biases, norms) on the wire.
        self._dense_dtype = WIRE_DTYPES[config.dense_wire_dtype or config.wire_dtype]
        kernels.start_threads()  # on the building (main) thread

    # --- the warm-up schedule and local clipping ----------------------------------------------
    def check_schedule(self) -> None:
        """Refuse to run an epoch-counted warm-up whose epoch nobody sets (it would never advance).

        The hook state and the optimizer call it on the user's thread before a step's first
        bucket, so the error reaches the caller instead of an engine thread.
        """
        cfg = self.config
        if cfg.warmup_unit == "epoch" and cfg.warmup_densities and not self._epoch_told:
            raise RuntimeError(
                f"{type(self).__name__}: the warm-up counts epochs (warmup_unit='epoch') but no "
                "epoch was set, so it would stay at its first stage "
                f"({cfg.density_at(0, 0):g}) for ever: call set_epoch(epoch) at the start of "
                "every epoch (on the hook state or the DistributedOptimizer), or count steps "
                "(warmup_unit='step', the default)")

    def density_in_force(self) -> float:
        """Return the density the warm-up schedule prescribes now."""
        self.check_schedule()
        return self.config.density_at(self.epoch, self.step)

    def in_warmup(self) -> bool:
        """Whether a warm-up stage (not the target density) is in force."""
        return self.config.in_warmup(self.epoch, self.step)

    def clip_local(self, flat: torch.Tensor, layout: Layout, loss_scale: float = 1.0) -> None:
        """DGC's local clipping: scale each parameter's gradient to norm <= clip_norm / sqrt(n).

        `flat` is in loss-scaled units, so the bound is scaled too. Per parameter, as DGC's
        implementation clips per tensor, so the result does not depend on the bucketing.
        """
        bound = self.config.clip_norm * float(loss_scale) / math.sqrt(self.world_size)
        parts = [flat[start:end] for _, start, end in layout.slices() if end > start]
        if not parts:
            return
        norms = torch.stack([torch.linalg.vector_norm(p) for p in parts])
        factors = (bound / norms.clamp(min=1e-30)).clamp_(max=1.0).tolist()  # one sync
        for p, f in zip(parts, factors):
            if f < 1.0:
                p.mul_(f)

    def _plan(self, layout: Layout, device: torch.device) -> Plan:
        key = (layout, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build_plan(layout, self.config, device)
        return plan

    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0,
               final: bool = False) -> StageGen:
        """Return the CSC StageGen for one buffer (2 collectives; see the module docstring)."""
        results = yield from self.reduce_many([flat], [layout], loss_scale=loss_scale,
                                              final=final)
        return results[0]

    def prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float = 1.0,
                terms: SGDTerms | None = None) -> Prepared:
        """v = grad + residual (+ momentum) and the chunk norms of one buffer, ahead of its
        batch (the module docstring's rule: only spare buffers are written). `terms`: the
        optimizer's momentum and weight decay for this step (None: the config's momentum, no
        decay)."""
        layout.check(flat, "CSCCompressor.prepare")
        return self._prepare(flat, layout, loss_scale, terms)

    def reduce_many(self, flats: Sequence[torch.Tensor], layouts: Sequence[Layout], *,
                    loss_scale: float = 1.0, final: bool = False,
                    prepared: Sequence[Prepared | None] | None = None) -> StageGen:
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
        c, wire_dtype = cfg.chunk_size, cfg.torch_wire_dtype
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
        finite = [_all_finite(reduced1)]
        chosen = self._choose(live, reduced1, density)

        # --- stage 2: the chosen chunks pre-scaled by 2^e/n (+ the dense part in the wire dtype)
        payloads = [self._pack(it, ch) for it, ch in zip(live, chosen)]
        own = [it for it in live if it.route is DenseRoute.OWN_STAGE]
        send = _cat([p.send for p in payloads], wire_dtype)
        if send.numel() or own:
            reduced2 = yield from self._stage(send, final=final and not own)
            finite.append(_all_finite(reduced2))
        else:
            # Nothing chosen and no dense part (the same on every rank: the quotas are the
            # same everywhere): no second collective.
            reduced2 = send
        parts = reduced2.split([p.send.numel() for p in payloads])
        dense = {id(it): (ch.dense_reduced, it.dense_local) for it, ch in zip(live, chosen)}
        for it, p, part in zip(live, payloads, parts):
            if it.route is DenseRoute.WITH_CHUNKS:
                dense[id(it)] = (part[p.k * c:], p.local[p.k * c:])
        if own:
            # A dense dtype that is neither fp32 nor the chunks' wire dtype: its own stage.
            dense_dtype = self._dense_dtype
            thirds = [kernels.cast_scaled(it.dense_v, 1.0 / n, dense_dtype) for it in own]
            locals_ = [t.clone() for t in thirds]
            reduced3 = yield from self._stage(_cat(thirds, dense_dtype), final=final)
            finite.append(_all_finite(reduced3))
            for it, part, loc in zip(own, reduced3.split([t.numel() for t in thirds]), locals_):
                dense[id(it)] = (part, loc)
        for it, ch, p, part in zip(live, chosen, payloads, parts):
            self._finish(it, ch, p, part[: p.k * c], *dense[id(it)], mask)
        ok = finite[0] if len(finite) == 1 else torch.stack(finite).all()
        self._settle(ok, [it.flat for it in live])
        return list(flats)

    def _prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float,
                 terms: SGDTerms | None) -> Prepared:
        """v = grad + residual (+ momentum) and the chunk norms of one buffer, and its stage-1
        tensor; writes only spare buffers (the module docstring's rule)."""
        cfg, n = self.config, self.world_size
        c, numel = cfg.chunk_size, flat.numel()
        it = Prepared(flat, layout, kernels.nchunks_of(numel, c))
        if numel == 0:
            return it
        plan = it.plan = self._plan(layout, flat.device)
        d = plan.dense_numel
        # A bucket of dense parameters only (e.g. all BN) has no chunk worth sending.
        it.eligible = d != numel
        wire_dtype, dense_dtype = cfg.torch_wire_dtype, self._dense_dtype
        it.route = DenseRoute.of(d, dense_dtype, wire_dtype)
        if cfg.clip_norm is not None:
            self.clip_local(flat, layout, loss_scale)
        terms = self._own_terms if terms is None else terms
        # Weight decay enters after clipping and before the momentum, as in SGD (and DGC).
        terms.add_decay(flat)
        # Each state slot has a spare: the new values are written there and committed by a swap,
        # so a step found non-finite later (even in another bucket) can be undone.
        ef, mc = cfg.error_feedback, cfg.momentum_correction
        it.slots = (("residual", "_residual_spare") if ef else ()) + (
            ("momentum", "_momentum_spare") if mc else ()
        )
        if mc:
            self._align_velocity(terms)
        mem = it.mem = self.memory.get(layout, it.slots, flat, loss_scale) if it.slots else {}
        mom_kw = {}
        if mc:
            mom_kw = dict(momentum=mem["momentum"], momentum_out=mem["_momentum_spare"],
                          m=terms.momentum, nesterov=terms.nesterov)
        if ef:
            # v goes straight into the spare residual (the new residual wherever nothing is sent)
            # and the bucket is zeroed while it is in cache: after the collectives only the k sent
            # chunks are written (unpack_sent), not a second full pass over the bucket.
            it.v = mem["_residual_spare"]
            norms = kernels.chunk_norms(
                flat, mem["residual"], c, cfg.norm, v_out=it.v, zero_grad=True, **mom_kw
            )
        else:
            it.v = flat
            norms = kernels.chunk_norms(flat, None, c, cfg.norm, **mom_kw)
        if d:
            it.dense_v = it.v.index_select(0, plan.dense_idx)
            kernels.masked_chunk_norms(
                it.v, plan.mixed_chunks, plan.mixed_keep, c, cfg.norm, out=norms
            )
        stage1 = norms
        if it.route is DenseRoute.WITH_NORMS:  # the dense part travels with the norms, in fp32
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
        no commit of the step has happened yet). The buffer's value is unchanged: only the
        factor it is stored with.
        """
        want, have = terms.velocity_factor, self._velocity_factor
        if want != have:
            if have:
                self.memory.scale_slot("momentum", want / have)
            self._velocity_factor = want

    def velocity_factor(self) -> float:
        """What the stored velocity is SGD's momentum buffer times (1, or m under Nesterov)."""
        return self._velocity_factor

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

    def _choose(self, live: list[Prepared], reduced1: torch.Tensor,
                density: float) -> list[Chosen]:
        """Each buffer's reduced norms, dense part and wire scale, and the chunks to send."""
        cfg, n = self.config, self.world_size
        got = []
        for it, part in zip(live, reduced1.split([it.stage1.numel() for it in live])):
            part, ws = wire_scale.split_bound(part, it.scaled, n, cfg.torch_wire_dtype)
            dense = part[it.nch:] if it.route is DenseRoute.WITH_NORMS else None
            got.append((part[:it.nch], ws, dense))
        # A non-finite norm ranks first (kernels.select_chunks), so the chunk that overflowed
        # is sent and every rank receives it.
        idxs = select_pool([g[0] for g in got], density, quota=cfg.selection,
                           eligible=[it.eligible for it in live])
        out = []
        for it, (norms, ws, dense), idx in zip(live, got, idxs):
            self.stats.add_bucket(numel=it.numel, chunks_sent=idx.numel(), chunks_total=it.nch,
                                  elements_sent_dense=it.dense_numel, density=density,
                                  warmup=self.in_warmup())
            out.append(Chosen(norms, ws, idx, dense))
        return out

    def _pack(self, it: Prepared, ch: Chosen) -> Payload:
        """One buffer's stage-2 tensor: its chosen chunks, then its dense part in the wire dtype."""
        cfg, n = self.config, self.world_size
        c, wire_dtype = cfg.chunk_size, cfg.torch_wire_dtype
        k = ch.idx.numel()
        with_dense = it.route is DenseRoute.WITH_CHUNKS
        send = torch.empty(k * c + (it.dense_numel if with_dense else 0), dtype=wire_dtype,
                           device=it.flat.device)
        kernels.pack_chunks(it.v, ch.idx, c, ch.ws.pre, wire_dtype, out=send[: k * c])
        if with_dense:
            kernels.cast_scaled(it.dense_v, 1.0 / n, wire_dtype, out=send[k * c:])
        # The local copy gives the exact rounding error (of the cast and of the 1/n pre-scale).
        local = send.clone() if cfg.error_feedback or with_dense else None
        return Payload(send, k, local)

    def _finish(self, it: Prepared, ch: Chosen, p: Payload, reduced_chunks: torch.Tensor,
                dense_reduced: torch.Tensor | None, dense_local: torch.Tensor | None,
                mask: bool) -> None:
        """Write one buffer's average in place, and commit its residual and momentum.

        mask: apply factor masking to the sent chunks' momentum (False in a step at density 1,
        which sends every chunk)."""
        cfg, n = self.config, self.world_size
        c, flat, plan, idx, k = cfg.chunk_size, it.flat, it.plan, ch.idx, p.k
        ef, mc, d = cfg.error_feedback, cfg.momentum_correction, it.dense_numel
        new_residual = it.mem.get("_residual_spare")
        # --- out (in place over v) and the new residual in one pass, then the dense part --------
        if ef:
            # flat is zero and new_residual holds v: only the sent chunks change.
            kernels.unpack_sent(flat, new_residual, reduced_chunks, p.local[: k * c], idx, c,
                                ch.ws.post, ch.ws.err)
        else:
            kernels.unpack_update(flat, None, reduced_chunks, None, idx, c, ch.ws.post,
                                  ch.ws.err, out=flat)
        if d:
            kernels.dense_scatter(flat, new_residual if ef else None, plan.dense_idx,
                                  dense_reduced, dense_local, it.dense_v, 1.0, float(n))
        if mc and mask and k:
            u = it.mem["_momentum_spare"]
            # Factor masking (DGC): the velocity of what was sent starts again from zero; dense
            # parameters are sent every step, so they keep theirs (plain heavy-ball momentum).
            # A step at density 1 (the warm-up's dense stage) sends every chunk, none of them
            # stale, so it masks nothing: it is then SGD with momentum on the average (up to the
            # wire's rounding, which stays in the residual), as dense training would be.
            dense_u = u.index_select(0, plan.dense_idx) if d else None
            # the sent chunks take zeros (unpack_sent writes only those: no host read)
            kernels.unpack_sent(u, None, u.new_zeros(k * c), None, idx, c, 1.0, 1.0)
            if d:
                u.index_copy_(0, plan.dense_idx, dense_u)
        if it.slots:
            self.memory.commit(it.layout, tuple(zip(it.slots[::2], it.slots[1::2])))

    def _settle(self, ok: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """Keep the batch's finiteness for end_step, and make each output of a non-finite
        batch show it: GradScaler then skips the step on every rank (a chunk whose norm
        overflowed while its values did not would otherwise arrive finite)."""
        self._note_finite(ok)
        for out in outputs:
            head = out[:1]
            head.copy_(torch.where(ok, head, torch.full_like(head, math.nan)))
