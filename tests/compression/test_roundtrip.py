"""What crosses the wire is the compressed payload and nothing else (GRACE once sent the raw
tensor)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, grads_for, layouts, make_ranks, method_config, recording
from gradientflow.compression import CompressionConfig
from gradientflow.compression.wire_scale import scale_for
from gradientflow.engine.stages import drive_lockstep


def _dense_mask(cfg, layout):
    mask = torch.zeros(layout.numel, dtype=torch.bool)
    for (name, s, e), shape in zip(layout.slices(), layout.shapes):
        mask[s:e] = cfg.is_dense_param(shape)
    return mask


@SETTINGS
@given(layout=layouts(), world=st.integers(1, 4), density=st.sampled_from([0.05, 0.25, 0.6]),
       chunk=st.sampled_from([4, 16, 64]), wire=st.sampled_from(["fp16", "bf16", "fp32"]),
       seed=st.integers(0, 2**16))
def test_csc_sends_only_norms_chunks_and_dense_part(layout, world, density, chunk, wire, seed):
    """Every yielded tensor has the size the algorithm prescribes; the output lives only where
    something was sent."""
    cfg = CompressionConfig(method="csc", density=density, chunk_size=chunk, wire_dtype=wire,
                            warmup_densities=(), min_numel=0)
    comps = make_ranks(cfg, world)
    wrap, log = recording()
    grads = grads_for(world, layout.numel, seed)
    gens = [wrap(c.reduce(g.clone(), layout), i) for i, (c, g) in enumerate(zip(comps, grads))]
    out = drive_lockstep(gens)[0]
    n = layout.numel
    nch = math.ceil(n / chunk)
    dense = _dense_mask(cfg, layout)
    d = int(dense.sum())
    k = 0 if d == n else min(nch, max(1, math.ceil(density * nch)))
    sent = log[0]
    wdt = cfg.torch_wire_dtype
    # An FP16 wire also sends its scale's bound (one FP32 element) with the norms.
    bound = 1 if wire == "fp16" and k > 0 else 0
    assert sent[0].dtype == torch.float32
    assert sent[0].numel() == nch + (d if wire == "fp32" else 0) + bound
    second = k * chunk + (0 if wire == "fp32" else d)
    # Nothing to send in the second stage (every parameter dense, and dense in fp32 with the
    # norms): no second collective at all.
    assert len(sent) == (2 if second else 1)
    if second:
        assert sent[1].dtype == wdt and sent[1].numel() == second
    wire_bytes = sum(t.numel() * t.element_size() for t in sent)
    assert comps[0].stats.current.wire_bytes == wire_bytes
    # Outside the dense parameters, the output is non-zero in at most the k chunks that were sent.
    nz = (out != 0) & ~dense
    assert torch.unique(nz.nonzero().view(-1) // chunk).numel() <= k
    if k * chunk + d < n:
        assert second + (d if wire == "fp32" else 0) < n, (
            "sent as many values as the dense buffer"
        )


@SETTINGS
@given(
    layout=layouts(),
    world=st.integers(1, 3),
    chunk=st.sampled_from([4, 32]),
    seed=st.integers(0, 2**16),
)
def test_csc_output_is_exactly_the_reduced_payload(layout, world, chunk, seed):
    """Unpacking the recorded payload by hand reproduces the output, and the residual is v where
    nothing was sent."""
    cfg = CompressionConfig(method="csc", density=0.3, chunk_size=chunk, wire_dtype="fp16",
                            warmup_densities=(), min_numel=0, dense_1d=False)
    comps = make_ranks(cfg, world)
    wrap, log = recording()
    grads = grads_for(world, layout.numel, seed)
    outs = drive_lockstep(
        [wrap(c.reduce(g.clone(), layout), i) for i, (c, g) in enumerate(zip(comps, grads))]
    )
    n, nch = layout.numel, math.ceil(layout.numel / chunk)
    # what the transport summed, re-summed here
    total = sum(log[i][1].float() for i in range(world))
    k = total.numel() // chunk
    # The k chosen chunks are the top-k of the summed norms (ties to the lower index); the
    # stage's last element is the FP16 scale's bound, whose sum sets the power of two.
    stage1 = sum(log[i][0] for i in range(world))
    norms = stage1[:nch]
    total = total * scale_for(float(stage1[nch]), world, torch.float16).post
    order = torch.sort(norms, descending=True, stable=True).indices[:k]
    idx = torch.sort(order).values
    expect = torch.zeros(nch * chunk)
    expect.view(nch, chunk)[idx] = total.view(k, chunk)
    torch.testing.assert_close(outs[0], expect[:n], rtol=2e-3, atol=2e-3)
    unsent = torch.ones(nch * chunk, dtype=torch.bool)
    unsent.view(nch, chunk)[idx] = False
    unsent = unsent[:n]
    r0 = comps[0].memory.state_dict()["residual"]
    flat_r = torch.cat([r0[name].reshape(-1) for name in layout.names])
    assert torch.equal(flat_r[unsent], grads[0][unsent])


@SETTINGS
@given(world=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_fp16_prescale_never_overflows_where_a_post_scaled_sum_would(world, seed):
    """Values that fit FP16 on every rank average without overflow, although their plain FP16 sum is
    inf."""
    gen = torch.Generator().manual_seed(seed)
    grads = [30000 + 35000 * torch.rand(256, generator=gen) for _ in range(world)]
    post = sum(g.half() for g in grads)
    assert not bool(torch.isfinite(post).all())  # the post-scaled (sum, then divide) way overflows
    from gradientflow.compression import Layout
    layout = Layout.from_shapes([("w", (16, 16))])
    for method, extra in (("fp16", {}), ("csc", dict(density=1.0, chunk_size=16))):
        cfg = method_config(method, wire_dtype="fp16", warmup_densities=(), **extra)
        comps = make_ranks(cfg, world)
        out = drive_lockstep([c.reduce(g.clone(), layout) for c, g in zip(comps, grads)])[0]
        assert bool(torch.isfinite(out).all()), method
        torch.testing.assert_close(out, sum(grads) / world, rtol=4e-3, atol=0)


def test_wire_bytes_follow_the_one_definition():
    """Per step: 4 bytes per chunk norm + wire bytes of k chunks + dense elements; dense FP32 = 4
    bytes/element."""
    from gradientflow.compression import Layout
    layout = Layout.from_shapes([("w", (100, 100)), ("b", (100,)), ("w2", (50, 40))])
    cfg = CompressionConfig(method="csc", density=0.05, chunk_size=64, warmup_densities=(0.5,),
                            warmup_unit="step", warmup_period=2, min_numel=0)
    comps = make_ranks(cfg, 2)
    for t in range(5):
        grads = grads_for(2, layout.numel, t)
        drive_lockstep([c.reduce(g.clone(), layout) for c, g in zip(comps, grads)])
        for c in comps:
            c.end_step()
    s = comps[0].stats.as_dict()
    n, nch = layout.numel, math.ceil(layout.numel / 64)
    k_steady, k_warm = math.ceil(0.05 * nch), math.ceil(0.5 * nch)
    # 4 bytes per norm and for the FP16 scale's bound, 2 per FP16 element.
    steady = 4 * (nch + 1) + 2 * (k_steady * 64 + 100)
    warm = 4 * (nch + 1) + 2 * (k_warm * 64 + 100)
    assert s["steps"] == 5 and s["steady_steps"] == 3
    assert s["steady"]["wire_bytes"] == steady
    assert s["average"]["wire_bytes"] == (2 * warm + 3 * steady) / 5
    assert s["steady"]["dense_fp32_bytes"] == 4 * n
    assert s["density_in_force"] == 0.05
    assert s["steady"]["chunks_sent"] == k_steady
