"""Nothing is lost: what the ranks applied plus what they still hold equals what they produced."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from compression_helpers import (
    SETTINGS,
    method_config,
    flat_slot,
    grads_for,
    layouts,
    lost_tolerance,
    make_ranks,
    step,
)
from gradientflow.compression import CompressionConfig


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 4),
    density=st.sampled_from([0.05, 0.2, 0.5, 1.0]),
    chunk=st.sampled_from([1, 7, 32, 100]),
    steps=st.integers(1, 5),
    method=st.sampled_from(["csc", "fp16"]),
    wire=st.sampled_from(["fp32", "fp16", "bf16"]),
    dense_wire=st.sampled_from([None, "fp32", "fp16"]),
    seed=st.integers(0, 2**16),
)
def test_nothing_lost_without_momentum(
    layout, world, density, chunk, steps, method, wire, dense_wire, seed
):
    """sum_ranks(applied so far) + sum_ranks(residual) == sum of all gradients, within the wire
    sum's rounding.

    The applied update of a step is the same on every rank (the average), so the sum over ranks
    of what was applied is world x the output.
    """
    if method == "fp16" and wire == "fp32":
        wire = "fp16"
    cfg = method_config(method, density=density, chunk_size=chunk, wire_dtype=wire,
                            dense_wire_dtype=dense_wire, warmup_densities=(), min_numel=0,
                            momentum_correction=False)
    comps = make_ranks(cfg, world)
    produced = torch.zeros(layout.numel, dtype=torch.float64)
    applied = torch.zeros_like(produced)
    sent_abs = torch.zeros_like(produced)  # sum over steps and ranks of |gradient + residual|
    for t in range(steps):
        grads = grads_for(world, layout.numel, seed + t)
        for c, g in zip(comps, grads):
            produced += g.double()
            sent_abs += (g.double() + flat_slot(c, layout)).abs()
        outs = step(comps, layout, grads)
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), "ranks disagree on the averaged gradient"
        applied += world * outs[0].double()
    held = sum(flat_slot(c, layout) for c in comps)
    err = (applied + held - produced).abs()
    tol = lost_tolerance(cfg, world, sent_abs)
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (worst, err[worst].item(), tol[worst].item())


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 3),
    density=st.sampled_from([0.1, 0.3, 1.0]),
    chunk=st.sampled_from([1, 16, 50]),
    steps=st.integers(1, 5),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_momentum_correction_identity(layout, world, density, chunk, steps, nesterov, seed):
    """With momentum correction the residual holds accumulated velocity. Identity (DGC):

    each step a rank adds its increment a_t = u_t (Nesterov: u_t + g_t) to its residual, where
    u_t = m * u_{t-1} + g_t (Nesterov: (u_{t-1} + g_t) * m) and u_{t-1} is the factor-MASKED
    momentum the rank held; then sum_ranks(applied so far) + sum_ranks(residual) == sum_ranks sum_t
    a_t.
    Factor masking: after the step, the momentum is 0 in every sent chunk (outside dense
    parameters) and u_t elsewhere; at density 1 (every chunk sent every step) it is u_t
    everywhere.
    """
    m = 0.9
    cfg = CompressionConfig(
        method="csc",
        density=density,
        chunk_size=chunk,
        wire_dtype="fp32",
        warmup_densities=(),
        momentum_correction=True,
        momentum=m,
        nesterov=nesterov,
        min_numel=0,
    )
    comps = make_ranks(cfg, world)
    increments = torch.zeros(layout.numel, dtype=torch.float64)
    applied = torch.zeros_like(increments)
    dense_mask = torch.zeros(layout.numel, dtype=torch.bool)
    for (name, s, e), shape in zip(layout.slices(), layout.shapes):
        dense_mask[s:e] = cfg.is_dense_param(shape)
    for t in range(steps):
        grads = grads_for(world, layout.numel, seed + t)
        velocities = []
        for c, g in zip(comps, grads):
            u_prev = flat_slot(c, layout, "momentum")
            u = (u_prev + g.double()) * m if nesterov else m * u_prev + g.double()
            velocities.append(u)
            increments += u + g.double() if nesterov else u
        outs = step(comps, layout, grads)
        applied += world * outs[0].double()
        sent = outs[0] != 0  # positions that received something (sent chunks / dense)
        for c, u in zip(comps, velocities):
            u_now = flat_slot(c, layout, "momentum")
            keep = ~sent | dense_mask | (density >= 1.0)
            assert torch.allclose(u_now[keep], u[keep], atol=1e-4 * (t + 1))
            assert torch.all(u_now[~keep] == 0)
    held = sum(flat_slot(c, layout) for c in comps)
    err = (applied + held - increments).abs().max().item()
    assert err <= 1e-4 * steps * steps * world * 10, err


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 4),
    chunk=st.sampled_from([1, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_density_one_fp32_is_the_plain_average(layout, world, chunk, seed):
    """Density 1 on an FP32 wire gives what plain DDP gives (sum / world), step after step."""
    cfg = CompressionConfig(method="csc", density=1.0, chunk_size=chunk, wire_dtype="fp32",
                            dense_wire_dtype="fp32", warmup_densities=(), momentum_correction=False)
    comps = make_ranks(cfg, world)
    ref = make_ranks(CompressionConfig(method="none"), world)
    for t in range(3):
        grads = grads_for(world, layout.numel, seed + t)
        out = step(comps, layout, grads)[0]
        plain = step(ref, layout, grads)[0]
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain, sum(grads) / world, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 3),
    chunk=st.sampled_from([1, 8, 64]),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_density_one_with_momentum_correction_is_sgd_momentum(layout, world, chunk, nesterov,
                                                               seed):
    """Density 1 (the warm-up's dense stage) under momentum correction on an FP32 wire sends,
    step after step, what SGD's momentum buffer on the plain average would apply: nothing is
    stale, so factor masking must not reset the velocity."""
    m = 0.9
    cfg = CompressionConfig(method="csc", density=1.0, chunk_size=chunk, wire_dtype="fp32",
                            dense_wire_dtype="fp32", warmup_densities=(), min_numel=0,
                            momentum_correction=True, momentum=m, nesterov=nesterov)
    comps = make_ranks(cfg, world)
    buf = torch.zeros(layout.numel, dtype=torch.float64)
    for t in range(4):
        grads = grads_for(world, layout.numel, seed + t)
        avg = sum(g.double() for g in grads) / world
        buf = m * buf + avg  # torch.optim.SGD's buffer (dampening 0)
        want = avg + m * buf if nesterov else buf
        out = step(comps, layout, grads)[0].double()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 3),
    chunk=st.sampled_from([1, 8, 64]),
    momenta=st.lists(st.sampled_from([0.0, 0.5, 0.9, 0.99]), min_size=4, max_size=4),
    nesterov=st.lists(st.booleans(), min_size=4, max_size=4),
    wd=st.sampled_from([0.0, 1e-3, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_density_one_follows_the_terms_of_every_step(layout, world, chunk, momenta, nesterov, wd,
                                                      seed):
    """Given each step's SGDTerms (a momentum schedule, Nesterov switched on and off, weight
    decay times the parameters), density 1 on an FP32 wire sends what torch.optim.SGD's buffer
    on the plain average would apply (d = g + wd*p, buf = m*buf + d, Nesterov: d + m*buf)."""
    from gradientflow.compression.sgd import SGDTerms
    from gradientflow.engine.stages import drive_lockstep

    cfg = CompressionConfig(method="csc", density=1.0, chunk_size=chunk, wire_dtype="fp32",
                            warmup_densities=(), min_numel=0, momentum_correction=True)
    comps = make_ranks(cfg, world)
    param = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))
    buf = torch.zeros(layout.numel, dtype=torch.float64)
    for t, (m, nest) in enumerate(zip(momenta, nesterov)):
        nest = nest and m > 0  # SGD refuses Nesterov without momentum
        terms = SGDTerms(m, nest, ((0, layout.numel, param, wd),) if wd else ())
        grads = grads_for(world, layout.numel, seed + t)
        d = sum(g.double() for g in grads) / world + wd * param.double()
        buf = m * buf + d
        want = d + m * buf if nest else buf
        flats = [g.clone() for g in grads]
        prepared = [c.prepare(f, layout, 1.0, terms) for c, f in zip(comps, flats)]
        outs = drive_lockstep([c.reduce_many([f], [layout], prepared=[p])
                               for c, f, p in zip(comps, flats, prepared)])
        for c in comps:
            c.end_step()
        torch.testing.assert_close(outs[0][0].double(), want, rtol=1e-4, atol=1e-5)
