"""CSC over a fused batch of buffers (reduce_many), on simulated ranks.

- selection="pool": the batch gives the same outputs and residuals as one buffer holding the
  same parameters, whatever the cut into buckets (at chunk boundaries);
- selection="bucket": the batch gives what each buffer gets alone, FP16 wire included.
"""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, flat_slot, grads_for, make_ranks
from gradientflow.compression import CompressionConfig, Layout
from gradientflow.engine.stages import drive_lockstep

CHUNK = 4


@st.composite
def chunked_params(draw):
    """Parameters whose sizes are whole chunks (matrices sparsified, vectors sent dense), and a
    cut of them into 1-4 buckets."""
    n = draw(st.integers(2, 7))
    shapes = []
    for i in range(n):
        if draw(st.integers(0, 3)) == 0:
            shapes.append((f"v{i}", (CHUNK * draw(st.integers(1, 3)),)))
        else:
            shapes.append((f"w{i}", (draw(st.integers(1, 6)), CHUNK * draw(st.integers(1, 4)))))
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3))))
    return shapes, cuts


def _batch_step(comps, layouts, grads_by_rank, final=False):
    """One step of reduce_many on every rank; the per-rank lists of outputs."""
    gens = [c.reduce_many([g.clone() for g in grads], layouts, final=final)
            for c, grads in zip(comps, grads_by_rank)]
    outs = drive_lockstep(gens)
    for c in comps:
        c.end_step()
    return outs


def _split(flat, layouts):
    return list(flat.split([lay.numel for lay in layouts]))


@SETTINGS
@given(params=chunked_params(), world=st.integers(1, 3), density=st.sampled_from([0.1, 0.3]),
       seed=st.integers(0, 2**16))
def test_pool_selection_equals_one_buffer_of_the_same_parameters(params, world, density, seed):
    shapes, cuts = params
    bounds = [0] + cuts + [len(shapes)]
    layouts = [Layout.from_shapes(shapes[a:b]) for a, b in zip(bounds, bounds[1:])]
    whole = Layout.from_shapes(shapes)
    cfg = CompressionConfig(method="csc", density=density, chunk_size=CHUNK, wire_dtype="fp32",
                            warmup_densities=(), min_numel=0, selection="pool")
    pooled, single = make_ranks(cfg, world), make_ranks(cfg, world)
    for step in range(3):
        grads = grads_for(world, whole.numel, seed + step)
        outs = _batch_step(pooled, layouts, [_split(g, layouts) for g in grads], final=True)
        ref = _batch_step(single, [whole], [[g] for g in grads])
        for r in range(world):
            assert torch.equal(torch.cat(outs[r]), ref[r][0]), f"step {step} rank {r}"
    for r in range(world):
        res = torch.cat([flat_slot(pooled[r], lay) for lay in layouts])
        assert torch.equal(res, flat_slot(single[r], whole)), f"residual of rank {r}"
    assert pooled[0].stats.current.chunks_sent == single[0].stats.current.chunks_sent


@SETTINGS
@given(params=chunked_params(), world=st.integers(1, 3), density=st.sampled_from([0.1, 0.3]),
       wire=st.sampled_from(["fp16", "bf16", "fp32"]), seed=st.integers(0, 2**16))
def test_bucket_selection_in_a_batch_equals_each_buffer_alone(params, world, density, wire,
                                                             seed):
    shapes, cuts = params
    bounds = [0] + cuts + [len(shapes)]
    layouts = [Layout.from_shapes(shapes[a:b]) for a, b in zip(bounds, bounds[1:])]
    cfg = CompressionConfig(method="csc", density=density, chunk_size=CHUNK, wire_dtype=wire,
                            warmup_densities=(), min_numel=0, selection="bucket")
    batched = make_ranks(cfg, world)
    alone = [make_ranks(cfg, world) for _ in layouts]  # one compressor set per bucket
    for step in range(3):
        grads = [_split(g, layouts) for g in grads_for(world, sum(x.numel for x in layouts),
                                                       seed + step)]
        outs = _batch_step(batched, layouts, grads)
        for b, lay in enumerate(layouts):
            ref = _batch_step(alone[b], [lay], [[grads[r][b]] for r in range(world)])
            for r in range(world):
                assert torch.equal(outs[r][b], ref[r][0]), f"step {step} bucket {b} rank {r}"
