"""The FP16 wire's power-of-two scale: no overflow, no flush to zero down to FP32's normal range,
and the compressors' whole steps equal the pure-torch reference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gradientflow.compression import CompressionConfig, Layout, make_compressor
from gradientflow.compression import wire_scale as W
from gradientflow.engine.stages import drive_lockstep

pytestmark = pytest.mark.timeout(300)

F16 = torch.float16


@settings(deadline=None, max_examples=200)
@given(log_bound=st.floats(-126, 127), n=st.integers(1, 64))
def test_exponent_keeps_the_sum_in_range(log_bound, n):
    bound = 2.0 ** log_bound
    e = W.exponent_for(bound, n, F16)
    assert W.MIN_EXPONENT <= e <= W.MAX_EXPONENT
    scaled = bound * 2.0 ** e / n
    if e > W.MIN_EXPONENT:  # (beyond 2^100 x FP16's max, nothing fits FP16 at all)
        assert scaled <= W.HEADROOM * 65504.0  # the sum of n messages cannot overflow
    if W.MIN_EXPONENT < e < W.MAX_EXPONENT:  # e is the largest that fits: one more would not
        assert scaled * 2 > W.HEADROOM * 65504.0
    ws = W.scale_for(bound, n, F16)
    for v in (ws.pre, ws.post, ws.err):  # normal FP32 numbers: scaling is exact
        assert torch.finfo(torch.float32).tiny <= v <= torch.finfo(torch.float32).max


@settings(deadline=None, max_examples=200)
@given(log_bound=st.floats(-140, 128), special=st.sampled_from([None, 0.0, math.inf, math.nan]),
       n=st.integers(1, 64), dtype=st.sampled_from([F16, torch.bfloat16]))
def test_the_scale_kept_on_the_device_is_the_host_scale(log_bound, special, n, dtype):
    """On a GPU the agreed scale stays a tensor (TensorScale); its float32 values are the ones
    the host computes (WireScale), so CPU and GPU ranks scale alike."""
    bound = float(torch.tensor(2.0 ** log_bound if special is None else special,
                               dtype=torch.float32))
    host = W.scale_for(bound, n, dtype)
    dev = W.tensor_scale(torch.tensor([bound], dtype=torch.float32), n, dtype)
    for name in ("pre", "post", "err"):
        want = torch.tensor(getattr(host, name), dtype=torch.float32)
        assert torch.equal(getattr(dev, name), want), (name, getattr(dev, name), want)


def test_no_scale_where_none_is_needed():
    assert W.exponent_for(0.0, 4, F16) == 0
    assert W.exponent_for(float("inf"), 4, F16) == 0
    assert W.exponent_for(1e-30, 4, torch.bfloat16) == 0


@settings(deadline=None, max_examples=60)
@given(log_mag=st.floats(-120, 10), n=st.integers(1, 8), seed=st.integers(0, 2**16),
       spread=st.floats(0, 12))
def test_small_messages_travel_without_flushing(log_mag, n, seed, spread):
    """Values within 2^-spread of a message's largest arrive with FP16's relative precision,
    at any magnitude down to FP32's normal range; unscaled, small ones flush to zero."""
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** log_mag
    xs = [(torch.rand(64, generator=g) * (1 - 2.0 ** -spread) + 2.0 ** -spread)
          * torch.sign(torch.randn(64, generator=g)) * mag for _ in range(n)]
    exact = torch.stack([x.double() for x in xs]).sum(0) / n
    got = W.reference_average(xs, F16).double()
    bound = sum(float(x.abs().max()) for x in xs)
    # FP16 rounds each of the n casts and n - 1 sums relative to the largest possible value.
    tol = 2 * n * 2.0 ** -11 * bound / n * 2
    assert bool(torch.isfinite(got).all())
    assert float((got - exact).abs().max()) <= tol, (float((got - exact).abs().max()), tol)
    if log_mag < -40:  # far below FP16's subnormals: torch's hook sends zeros
        assert bool((W.reference_average(xs, F16, scaled=False) == 0).all())


def _ranks(cfg, n, layout, grads):
    comps = [make_compressor(cfg, n) for _ in range(n)]
    outs = drive_lockstep([c.reduce(g.clone(), layout) for c, g in zip(comps, grads)])
    return outs


@pytest.mark.parametrize("method", ["fp16", "csc"])
@pytest.mark.parametrize("log_mag", [-30, -8, 0, 10])
def test_compressors_keep_tiny_gradients(method, log_mag):
    """A whole step on 3 simulated ranks at magnitudes where torch's hook flushes."""
    n, numel = 3, 4096
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(numel, generator=g) * 2.0 ** log_mag for _ in range(n)]
    layout = Layout.from_shapes([("w", (64, 64))])
    csc = dict(density=1.0, chunk_size=256, warmup_densities=(), min_numel=0)
    cfg = CompressionConfig(method=method, error_feedback=False,
                            **(csc if method == "csc" else {}))
    outs = _ranks(cfg, n, layout, grads)
    exact = torch.stack(grads).double().sum(0) / n
    for out in outs:
        assert torch.equal(out, outs[0])
        rel = float((out.double() - exact).norm() / exact.norm())
        assert rel < 2e-3, (method, log_mag, rel)
    ref = W.reference_average(grads, F16)
    assert float((outs[0].double() - ref.double()).norm() / exact.norm()) < 2e-3


def test_bound_sums_cover_every_rank():
    """local_bound bounds |x + residual|; norms_bound bounds the chunk values (l1 and l2)."""
    x, r = torch.tensor([3.0, -5.0, 0.5]), torch.tensor([-1.0, 2.0, 4.0])
    assert float(W.local_bound(x, r)) >= float((x + r).abs().max())
    norms_l1 = torch.tensor([1.0, 7.0])
    norms_l2 = torch.tensor([1.0, 49.0])
    dense = torch.tensor([-9.0])
    assert float(W.norms_bound(norms_l1, "l1", None)) == 7.0
    assert math.isclose(float(W.norms_bound(norms_l2, "l2", dense)), 16.0)
