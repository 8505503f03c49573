"""DGC's local gradient clipping: a pure-torch reference and a property test."""
from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, layouts
from gradientflow.compression import CompressionConfig, make_compressor
from gradientflow.engine.stages import drive_lockstep


def clip_reference(flat: torch.Tensor, layout, clip_norm: float, world: int,
                   scale: float) -> torch.Tensor:
    """Each parameter's slice scaled to L2 norm <= clip_norm * scale / sqrt(world), in float64."""
    out = flat.double().clone()
    bound = clip_norm * scale / math.sqrt(world)
    for _, s, e in layout.slices():
        norm = float(out[s:e].norm())
        if norm > bound:
            out[s:e] *= bound / norm
    return out


@SETTINGS
@given(layout=layouts(), world=st.integers(1, 4), clip=st.sampled_from([1e-3, 0.5, 3.0, 1e3]),
       scale=st.sampled_from([1.0, 1024.0]), seed=st.integers(0, 2**16))
def test_clip_local_equals_the_reference(layout, world, clip, scale, seed):
    cfg = CompressionConfig(density=1.0, clip_norm=clip, warmup_densities=())
    comp = make_compressor(cfg, world)
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed)) * scale
    ref = clip_reference(flat, layout, clip, world, scale)
    comp.clip_local(flat, layout, scale)
    torch.testing.assert_close(flat.double(), ref, rtol=1e-5, atol=1e-7 * scale)
    bound = clip * scale / math.sqrt(world)
    for _, s, e in layout.slices():
        assert float(flat[s:e].double().norm()) <= bound * (1 + 1e-5)


def test_csc_clips_before_accumulating():
    """With a tiny clip_norm, a huge gradient enters residual and output as its clipped self."""
    from gradientflow.compression import Layout
    lay = Layout.from_shapes([("w", (8, 8))])
    cfg = CompressionConfig(density=1.0, chunk_size=8, wire_dtype="fp32", warmup_densities=(),
                            clip_norm=1.0, momentum_correction=False)
    comps = [make_compressor(cfg, 2) for _ in range(2)]
    grads = [torch.full((64,), 100.0), torch.full((64,), -100.0)]
    outs = drive_lockstep([c.reduce(g.clone(), lay) for c, g in zip(comps, grads)])
    assert torch.allclose(outs[0], torch.zeros(64), atol=1e-6)  # +-clipped cancel exactly
    outs = drive_lockstep([c.reduce(torch.full((64,), 100.0), lay) for c in comps])
    assert math.isclose(float(outs[0].norm()), 1.0 / math.sqrt(2), rel_tol=1e-5)
