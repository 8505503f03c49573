"""CSC with error feedback makes one pass over the bucket (v into the spare residual, the bucket
zeroed, then only the sent chunks written): its outputs and residuals are the two-pass torch
reference's, bit for bit."""

from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, layouts, make_ranks
from gradientflow import kernels as K
from gradientflow.compression import CompressionConfig
from gradientflow.engine.stages import drive_lockstep


def _reference_step(grads, residuals, chunk, k, world, wire):
    """The two-pass CSC step from the pure-torch kernels: v in place, full unpack_update pass."""
    vs = [g.clone() for g in grads]
    norms = sum(K.chunk_norms(v, r, chunk, impl="torch") for v, r in zip(vs, residuals))
    idx = K.select_chunks(norms, k, impl="torch")
    packed = [K.pack_chunks(v, idx, chunk, 1.0 / world, wire, impl="torch") for v in vs]
    total = torch.zeros_like(packed[0])
    for p in packed:  # the transport's sum, in rank order
        total += p
    outs = []
    for v, r, p in zip(vs, residuals, packed):
        K.unpack_update(v, r, total.clone(), p, idx, chunk, 1.0, float(world), out=v, impl="torch")
        outs.append(v)
    return outs


@SETTINGS
@given(layout=layouts(), world=st.sampled_from([1, 2, 4]), chunk=st.sampled_from([1, 4, 16, 64]),
       density=st.sampled_from([0.05, 0.3, 1.0]), wire=st.sampled_from(["fp16", "bf16", "fp32"]),
       seed=st.integers(0, 2**16))
def test_one_pass_equals_the_two_pass_reference(layout, world, chunk, density, wire, seed):
    """Three steps. Gradients on a 2^-6 grid below 16 make every norm exact in any summation order
    (so numba's and torch's selections agree), while bf16 (8 bits) still rounds: residuals differ
    from 0."""
    cfg = CompressionConfig(method="csc", density=density, chunk_size=chunk, wire_dtype=wire,
                            warmup_densities=(), min_numel=0, dense_1d=False,
                            momentum_correction=False)
    comps = make_ranks(cfg, world)
    gen = torch.Generator().manual_seed(seed)
    n = layout.numel
    nch = K.nchunks_of(n, chunk)
    k = min(nch, max(1, math.ceil(density * nch)))
    residuals = [torch.zeros(n) for _ in range(world)]
    wdt = cfg.torch_wire_dtype
    for _ in range(3):
        grads = [
            torch.randint(-1024, 1025, (n,), generator=gen).float() * 2.0**-6 for _ in range(world)
        ]
        outs = drive_lockstep([c.reduce(g.clone(), layout) for c, g in zip(comps, grads)])
        for c in comps:
            c.end_step()
        expect = _reference_step(grads, residuals, chunk, k, world, wdt)
        for rank in range(world):
            assert torch.equal(outs[rank].view(torch.int32), expect[rank].view(torch.int32))
            live = comps[rank].memory.get(layout, ("residual",), outs[rank])["residual"]
            assert torch.equal(live.view(torch.int32), residuals[rank].view(torch.int32))
