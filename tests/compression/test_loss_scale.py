"""A moving loss scale never weights a residual by a stale scale."""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from compression_helpers import (SETTINGS, FakeBucket, flat_slot, grads_for, layouts, make_ranks,
                                 method_config, step)
from gradientflow.compression import CompressionConfig, Layout
from gradientflow.engine.stages import drive_lockstep
from gradientflow.hooks import CSCState, FP16State


@SETTINGS
@given(layout=layouts(), world=st.integers(1, 3),
       method=st.sampled_from(["csc", "fp16", "powersgd"]),
       scales=st.lists(st.sampled_from([2.0 ** e for e in range(0, 12)]), min_size=2, max_size=6),
       seed=st.integers(0, 2**16))
def test_scaled_gradients_give_the_unscaled_result(layout, world, method, scales, seed):
    """reduce(g * S_t, loss_scale=S_t) / S_t equals reduce(g) step after step while S_t moves.

    Power-of-two scales are exact in binary floating point, so the two runs round alike except
    in FP16's subnormal range (hence a small absolute tolerance).
    """
    cfg = method_config(
        method,
        density=0.25,
        chunk_size=8,
        wire_dtype={"csc": "bf16", "fp16": "fp16", "powersgd": "fp32"}[method],
        warmup_densities=(),
        min_numel=0,
        momentum_correction=False,
        rank=2,
    )
    scaled, plain = make_ranks(cfg, world), make_ranks(cfg, world)
    for t, s in enumerate(scales):
        grads = grads_for(world, layout.numel, seed + t)
        a = step(scaled, layout, [g * s for g in grads], loss_scale=s)[0] / s
        b = step(plain, layout, grads)[0]
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(
        flat_slot(scaled[0], layout), flat_slot(plain[0], layout), rtol=1e-2, atol=1e-3
    )


def test_untold_scale_change_would_weight_the_residual_wrongly():
    """The control: a scale change the compressor is not told of gives a different (wrong)
    update."""
    layout = Layout.from_shapes([("w", (64, 64))])
    cfg = CompressionConfig(
        method="csc",
        density=0.1,
        chunk_size=64,
        wire_dtype="fp32",
        warmup_densities=(),
        momentum_correction=False,
        min_numel=0,
    )
    told, untold, plain = make_ranks(cfg, 1), make_ranks(cfg, 1), make_ranks(cfg, 1)
    for t, s in enumerate([1024.0, 8.0, 8.0]):
        g = grads_for(1, layout.numel, t)
        a = step(told, layout, [g[0] * s], loss_scale=s)[0] / s
        b = step(untold, layout, [g[0] * s])[0] / s
        c = step(plain, layout, g)[0]
        torch.testing.assert_close(a, c)
    assert not torch.allclose(b, c, rtol=1e-2, atol=1e-3)


def _train(world, use_scaler, inject_inf_at, state_cls, cfg_kwargs, steps=6):
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for _ in range(world)
    ]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = [
        torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1, enabled=use_scaler)
        for _ in range(world)
    ]
    states = []
    for r in range(world):
        st_ = state_cls(None, grad_scaler=scalers[r], world_size=world, rank=r, **cfg_kwargs)
        st_.bind_parameter_names(models[r])
        states.append(st_)
    data = torch.Generator().manual_seed(1)
    xs = [[torch.randn(8, 16, generator=data) for _ in range(world)] for _ in range(steps)]
    scales_seen = []
    for t in range(steps):
        buckets = []
        for r, m in enumerate(models):
            opts[r].zero_grad()
            loss = m(xs[t][r]).pow(2).mean()
            scalers[r].scale(loss).backward()
            if t == inject_inf_at and r == 0:
                next(iter(m.parameters())).grad[0, 0] = float("inf")
            params = list(m.parameters())
            buckets.append([FakeBucket(0, params[2:], False), FakeBucket(1, params[:2], True)])
        for b in range(2):
            outs = drive_lockstep([states[r]._stages(buckets[r][b]) for r in range(world)])
            for r in range(world):
                buckets[r][b].write_back(outs[r])
        for r in range(world):
            scalers[r].step(opts[r])
            scalers[r].update()
        scales_seen.append(scalers[0].get_scale() if use_scaler else 1.0)
    return models, states, scales_seen


def test_grad_scaler_with_a_moving_scale_matches_unscaled_training():
    """A real GradScaler (scale doubling every step, halving on an overflow) through the hook state
    trains like the unscaled run with the overflowing step skipped: the residual stays unscaled."""
    kw = dict(density=0.2, chunk_size=16, wire_dtype="fp16", warmup_densities=(), min_numel=0)
    scaled, s_states, scales = _train(2, True, 3, CSCState, kw)
    assert len(set(scales)) > 3 and scales[3] < scales[2]  # the scale really moved, both ways
    assert s_states[0].stats()["steps"] == 6
    # Reference: no scaler; the overflow step is skipped by not stepping at all (same data order).
    ref, r_states, _ = _train_skipping(kw)
    for a, b in zip(scaled[0].parameters(), ref[0].parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)


def _train_skipping(kw):
    """Unscaled twin of _train(2, True, 3, ...): step 3 is skipped (its gradients never enter the
    residual)."""
    world, steps = 2, 6
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for _ in range(world)
    ]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    states = []
    for r in range(world):
        st_ = CSCState(None, world_size=world, rank=r, **kw)
        st_.bind_parameter_names(models[r])
        states.append(st_)
    data = torch.Generator().manual_seed(1)
    xs = [[torch.randn(8, 16, generator=data) for _ in range(world)] for _ in range(steps)]
    for t in range(steps):
        if t == 3:
            continue
        buckets = []
        for r, m in enumerate(models):
            opts[r].zero_grad()
            m(xs[t][r]).pow(2).mean().backward()
            params = list(m.parameters())
            buckets.append([FakeBucket(0, params[2:], False), FakeBucket(1, params[:2], True)])
        for b in range(2):
            outs = drive_lockstep([states[r]._stages(buckets[r][b]) for r in range(world)])
            for r in range(world):
                buckets[r][b].write_back(outs[r])
        for r in range(world):
            opts[r].step()
    return models, states, None


def test_fp16_state_with_grad_scaler_runs():
    models, states, scales = _train(2, True, None, FP16State, dict(wire_dtype="fp16"), steps=3)
    # FP16 halves the bytes; the scale's bound adds 4 bytes per bucket (wire_scale.py).
    assert 1.95 < states[0].stats()["steady"]["ratio"] < 2.0
