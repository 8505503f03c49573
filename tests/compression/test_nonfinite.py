"""Non-finite gradients (a loss-scale overflow) leave every rank's residual and momentum as they
were."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, grads_for, layouts, make_ranks, method_config, step


def _states(comps):
    return [c.memory.state_dict() for c in comps]


def _same(a, b):
    assert a.keys() == b.keys()
    for slot in a:
        assert a[slot].keys() == b[slot].keys()
        for name in a[slot]:
            assert torch.equal(a[slot][name], b[slot][name]), (slot, name)


@SETTINGS
@given(
    layout=layouts(), world=st.integers(1, 3), bad_rank=st.integers(0, 2),
    bad=st.sampled_from([float("inf"), float("-inf"), float("nan")]), where=st.floats(0, 1),
    method=st.sampled_from(["csc", "csc-momentum", "fp16"]),
    wire=st.sampled_from(["fp16", "fp32"]), seed=st.integers(0, 2**16),
)
def test_non_finite_step_restores_state_on_every_rank(
    layout, world, bad_rank, bad, where, method, wire, seed
):
    """Every rank's output is non-finite (so GradScaler skips everywhere) and the next step is as if
    the bad one never happened."""
    bad_rank %= world
    if method == "fp16" and wire == "fp32":
        wire = "fp16"
    cfg = method_config(
        "fp16" if method == "fp16" else "csc",
        density=0.3,
        chunk_size=8,
        wire_dtype=wire,
        warmup_densities=(),
        momentum_correction=method == "csc-momentum",
        min_numel=0,
    )
    comps = make_ranks(cfg, world)
    for t in range(2):
        step(comps, layout, grads_for(world, layout.numel, seed + t))
    twin = copy.deepcopy(comps)
    before = _states(comps)
    grads = grads_for(world, layout.numel, seed + 2)
    grads[bad_rank][int(where * (layout.numel - 1))] = bad
    outs = step(comps, layout, grads)
    for out in outs:
        assert not bool(torch.isfinite(out).all())
    for b, a in zip(before, _states(comps)):
        _same(b, a)
    good = grads_for(world, layout.numel, seed + 3)
    after_bad = step(comps, layout, good)
    after_twin = step(twin, layout, good)
    for x, y in zip(after_bad, after_twin):
        assert torch.equal(x, y)
    for a, b in zip(_states(comps), _states(twin)):
        _same(a, b)


@SETTINGS
@given(
    world=st.integers(1, 3),
    method=st.sampled_from(["csc", "csc-momentum", "fp16"]),
    seed=st.integers(0, 2**16),
)
def test_a_later_bucket_overflowing_undoes_the_earlier_buckets_of_the_step(world, method, seed):
    """GradScaler skips the whole step, so a finite bucket reduced before an overflowing one is
    undone too."""
    from gradientflow.compression import Layout
    from gradientflow.engine.stages import drive_lockstep

    a = Layout.from_shapes([("a.weight", (20, 10)), ("a.bias", (20,))])
    b = Layout.from_shapes([("b.weight", (8, 20))])
    cfg = method_config("fp16" if method == "fp16" else "csc", density=0.3, chunk_size=8,
                            warmup_densities=(), momentum_correction=method == "csc-momentum")
    comps = make_ranks(cfg, world)
    for t in range(2):
        for lay in (a, b):
            drive_lockstep(
                [c.reduce(g, lay) for c, g in zip(comps, grads_for(world, lay.numel, seed + t))]
            )
        for c in comps:
            c.end_step()
    before = _states(comps)
    drive_lockstep([c.reduce(g, a) for c, g in zip(comps, grads_for(world, a.numel, seed + 5))])
    bad = grads_for(world, b.numel, seed + 6)
    bad[0][3] = float("nan")
    outs = drive_lockstep([c.reduce(g, b) for c, g in zip(comps, bad)])
    assert all(not bool(torch.isfinite(o).all()) for o in outs)
    for c in comps:
        c.end_step()
        assert c.stats.skipped_steps == 1
    for x, y in zip(before, _states(comps)):
        _same(x, y)
