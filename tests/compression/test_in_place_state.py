"""State kept in place (`Compressor.keep_state_in_place`, the FSDP2 path) instead of through a
spare buffer: the same steps, bit for bit, with one copy of the state instead of two; a
non-finite step leaves no non-finite value behind."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, grads_for, layouts, make_ranks, method_config, step

METHODS = ["csc", "csc-momentum", "fp16", "none"]


def _config(method: str, wire: str):
    return method_config("fp16" if method == "fp16" else "none" if method == "none" else "csc",
                         density=0.3, chunk_size=8, wire_dtype=wire, warmup_densities=(),
                         momentum_correction=method == "csc-momentum", min_numel=0)


@SETTINGS
@given(layout=layouts(), world=st.integers(1, 3), method=st.sampled_from(METHODS),
       wire=st.sampled_from(["fp16", "fp32"]), steps=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_in_place_state_steps_as_the_double_buffer_does_with_half_the_memory(
        layout, world, method, wire, steps, seed):
    if method == "fp16" and wire == "fp32":
        wire = "fp16"
    cfg = _config(method, wire)
    double, single = make_ranks(cfg, world), make_ranks(cfg, world)
    for c in single:
        c.keep_state_in_place()
    for t in range(steps):
        grads = grads_for(world, layout.numel, seed + t)
        for x, y in zip(step(double, layout, grads), step(single, layout, grads)):
            assert torch.equal(x, y), f"step {t}: the in-place state changed the result"
    for d, s in zip(double, single):
        a, b = d.memory.state_dict(), s.memory.state_dict()
        assert a.keys() == b.keys()
        for slot in a:
            for name in a[slot]:
                assert torch.equal(a[slot][name], b[slot][name]), (slot, name)
        assert 2 * s.memory.nbytes() == d.memory.nbytes()
        slots = len(a)  # residual, and the velocity under momentum correction
        assert s.memory.nbytes() == 4 * layout.numel * slots


@SETTINGS
@given(layout=layouts(), world=st.integers(1, 3), method=st.sampled_from(METHODS[:3]),
       bad=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
       where=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_a_non_finite_step_in_place_leaves_only_finite_state(layout, world, method, bad, where,
                                                             seed):
    comps = make_ranks(_config(method, "fp16"), world)
    for c in comps:
        c.keep_state_in_place()
    step(comps, layout, grads_for(world, layout.numel, seed))
    grads = grads_for(world, layout.numel, seed + 1)
    grads[0][int(where * (layout.numel - 1))] = bad
    outs = step(comps, layout, grads)
    assert all(not bool(torch.isfinite(o).all()) for o in outs)
    for rank, c in enumerate(comps):
        for slot, per_name in c.memory.state_dict().items():
            for name, t in per_name.items():
                assert bool(torch.isfinite(t).all()), f"rank {rank}: {slot} of {name} kept {bad}"
    after = step(comps, layout, grads_for(world, layout.numel, seed + 2))
    assert all(bool(torch.isfinite(o).all()) for o in after), "the next step is not finite"


def test_keep_state_in_place_is_refused_after_the_first_step():
    import pytest

    from gradientflow.compression import Layout

    layout = Layout.from_shapes([("w", (4, 4))])
    comps = make_ranks(_config("csc", "fp32"), 1)
    step(comps, layout, grads_for(1, layout.numel, 0))
    with pytest.raises(RuntimeError, match="before the first step"):
        comps[0].keep_state_in_place()
